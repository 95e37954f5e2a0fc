"""The MoE experts' two ways (engine/model/moe.py) side by side: the Python loop over the experts hit, and one
torch._grouped_mm per projection, which the engine takes on CUDA bf16 (sm90+) because it reads nothing back to the
host. On a CPU the grouped call falls back to a loop of its own inside PyTorch. Random experts of Qwen3-30B-A3B's
shape by default (128 experts, top 8, hidden 2,048, 768 each: one layer's, 2.4 GB in float32), random routing,
ms a call of each way for each token count (median of --rounds), and whether the two agree bit for bit. Ends with
one JSON line.

    python loadtest/bench_moe_experts.py
    python loadtest/bench_moe_experts.py --shape tiny --tokens 4 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from loadtest.common.gpu_moe_check import DRY_SHAPE, FULL_SHAPE, compare_ways

SHAPES = {"qwen3-30b-a3b": FULL_SHAPE, "tiny": DRY_SHAPE}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512], help="tokens a call (a step's)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bf16)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    shape = {**SHAPES[args.shape], "tokens": tuple(args.tokens), "rounds": args.rounds}
    report = compare_ways(device, torch.bfloat16 if device.type == "cuda" else torch.float32, shape)
    for tokens in args.tokens:
        print(f"{tokens:>5} tokens: loop {report[f'loop_ms_{tokens}_tokens']:8.2f} ms, "
              f"grouped {report[f'grouped_ms_{tokens}_tokens']:8.2f} ms", flush=True)
    print(json.dumps({"bench": "moe_experts", "torch_threads": torch.get_num_threads(), **report}), flush=True)
    return report


if __name__ == "__main__":
    main()
