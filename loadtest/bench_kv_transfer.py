"""KV transfer benchmark, side by side in one run:

1. bandwidth: GB/s of one 2k-token hand-off of the `small` model's KV, raw NIXL (one contiguous write) vs the
   fleet's path (per-layer block writes through NixlTransport) vs a copy inside one process;
2. TTFT: a 2k-token prompt on `small`, prefill alone vs with layer-by-layer writes vs one write per layer after
   the forward pass (time until the decode side holds all KV and the first token exists);
3. goodput: the real fleet colocated (2 workers) vs disaggregated (1 prefill + 1 decode), `tiny`, a mix of long
   prompts and short chats.

    python loadtest/bench_kv_transfer.py                # all three, short
    python loadtest/bench_kv_transfer.py --skip-goodput
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch  # noqa: E402

from flotilla.models.checkpoint import SIZES  # noqa: E402
from loadtest.common.checkpoint_cache import default_cache_dir, ensure_checkpoint  # noqa: E402
from loadtest.kv_transfer import bandwidth, goodput, ttft  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens) for TTFT")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-goodput", action="store_true")
    parser.add_argument("--goodput-long", type=int, default=6)
    parser.add_argument("--goodput-short", type=int, default=18)
    parser.add_argument("--ttft-target-s", type=float, default=2.0)
    parser.add_argument("--tpot-target-s", type=float, default=0.15)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    result: dict[str, object] = {}

    shape = SIZES["small"]
    layout = (shape.num_hidden_layers, 2, args.prompt_len // 16 + 8, 16, shape.num_key_value_heads, shape.head_dim)
    bw = bandwidth.measure(layout, args.prompt_len // 16, args.reps)
    print(f"bandwidth ({bw.num_bytes / 1e6:.1f} MB, {args.prompt_len} tokens of `small` KV in float32): raw NIXL "
          f"{bw.raw_nixl_gbps:.2f} GB/s, fleet path {bw.fleet_nixl_gbps:.2f} GB/s "
          f"({bw.fleet_nixl_gbps / bw.raw_nixl_gbps:.0%} of raw; {bw.fleet_notified_gbps:.2f} GB/s until the receiver saw "
          f"every per-layer notification), copy in one process {bw.in_process_copy_gbps:.2f} GB/s",
          flush=True)  # fmt: skip
    result["bandwidth"] = bw._asdict()

    if not args.skip_ttft:
        model_dir = ensure_checkpoint(default_cache_dir(), "small")
        t = ttft.measure(model_dir, args.prompt_len, args.chunk, args.reps)
        print(f"TTFT, {args.prompt_len}-token prompt on `small` (chunk {args.chunk}): prefill alone "
              f"{t.prefill_only_s * 1e3:.0f} ms, layer by layer {t.layerwise_s * 1e3:.0f} ms, one write after "
              f"prefill {t.after_prefill_s * 1e3:.0f} ms; transfer left after the last layer: layer by layer "
              f"{t.layerwise_exposed_s * 1e3:.1f} ms, after prefill {t.after_prefill_exposed_s * 1e3:.1f} ms "
              f"(layer by layer hides {t.hidden_fraction:.0%}; {t.num_bytes / 1e6:.1f} MB)", flush=True)  # fmt: skip
        result["ttft"] = {**t._asdict(), "hidden_fraction": t.hidden_fraction}

    if not args.skip_goodput:
        model_dir = ensure_checkpoint(default_cache_dir(), "tiny")
        requests = goodput.workload(args.goodput_long, args.goodput_short, long_words=700)
        worker_args = ["--num-kv-blocks", "2048", "--max-num-batched-tokens", "512"]
        rows = [goodput.run(model_dir, layout_name, requests, 8, args.ttft_target_s, args.tpot_target_s, worker_args)
                for layout_name in ("colocated", "disaggregated")]  # fmt: skip
        for row in rows:
            print(f"goodput {row.layout}: {row.num_good}/{row.num_requests} within TTFT {args.ttft_target_s} s and "
                  f"TPOT {args.tpot_target_s} s, {row.goodput_rps:.2f} req/s good (wall {row.wall_s:.1f} s, TTFT "
                  f"p50 {row.ttft_p50_s * 1e3:.0f} ms, TPOT p50 {row.tpot_p50_s * 1e3:.1f} ms)", flush=True)  # fmt: skip
        result["goodput"] = [{**row._asdict(), "goodput_rps": row.goodput_rps} for row in rows]

    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
