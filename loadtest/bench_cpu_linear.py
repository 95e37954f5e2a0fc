"""The CPU linears side by side: the engine's panel matmul (model/panel_gemm.py) on one and on all threads,
against oneDNN's packed matmul (model/cpu_linear.PackedLinear), at a model size's linear shapes and several row
counts (64 rows: a decode step of 64 sequences; 2,048: a full prefill step).

Calls come as a step's do: one after another with --gap-us of busy waiting between them, as the Python and
element-wise kernels between two linears of a layer (0 would flatter oneDNN, whose OpenMP threads are then still
awake, and the pool, whose workers are then still spinning). Median of --rounds rounds, us a call and GFLOP/s. The
largest difference from oneDNN's output, relative to its largest value, is float32 rounding only. Ends with one
JSON line.

    python loadtest/bench_cpu_linear.py --size tiny --rows 1 64 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# As bench_engine.py and the `flotilla` command's workers (before torch loads OpenMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from flotilla.engine.model import cpu_linear, panel_gemm  # noqa: E402
from flotilla.models.checkpoint import SIZES  # noqa: E402


def linear_shapes(size: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of a layer, and the lm_head, for a checkpoint size (models/checkpoint.py)."""
    shape = SIZES[size]
    hidden, heads, kv_heads = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads
    return {
        "qkv": (hidden, (heads + 2 * kv_heads) * shape.head_dim),
        "o": (heads * shape.head_dim, hidden),
        "gate_up": (hidden, 2 * shape.intermediate_size),
        "down": (shape.intermediate_size, hidden),
        "lm_head": (hidden, shape.vocab_size),
    }


def time_calls(call, gap_s: float, calls: int, rounds: int) -> float:
    """Median over rounds of the mean microseconds a call, the gap after each call not counted."""
    call()
    per_round = []
    for _ in range(rounds):
        busy = 0.0
        start = time.perf_counter()
        for _ in range(calls):
            call()
            gap_start = time.perf_counter()
            while time.perf_counter() - gap_start < gap_s:
                pass
            busy += time.perf_counter() - gap_start
        per_round.append((time.perf_counter() - start - busy) / calls * 1e6)
    return statistics.median(per_round)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gap-us", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--flops-per-round", type=float, default=2e9, help="sets the calls a round (at least 3)")
    args = p.parse_args(argv)
    if panel_gemm.load() is None or not cpu_linear.onednn_works():
        raise SystemExit("needs the panel kernel (a C compiler) and torch's oneDNN linear")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    for name, (in_features, out_features) in linear_shapes(args.size).items():
        linear = nn.Linear(in_features, out_features, bias=False)
        onednn, panel = cpu_linear.PackedLinear(linear), panel_gemm.PanelLinear(linear)
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            flops = 2 * rows * in_features * out_features
            calls = max(3, int(args.flops_per_round / flops))
            with torch.inference_mode():
                reference = onednn(x)
                error = ((panel(x) - reference).abs().max() / reference.abs().max()).item()
                us = {"onednn": time_calls(lambda: onednn(x), args.gap_us / 1e6, calls, args.rounds),
                      "panel": time_calls(lambda: panel(x), args.gap_us / 1e6, calls, args.rounds)}
                torch.set_num_threads(1)
                us["panel_1_thread"] = time_calls(lambda: panel(x), args.gap_us / 1e6, calls, args.rounds)
                torch.set_num_threads(args.threads)
            row = {"linear": name, "in": in_features, "out": out_features, "rows": rows,
                   "us": {k: round(v, 1) for k, v in us.items()},
                   "gflops": {k: round(flops / v / 1e3, 1) for k, v in us.items()},
                   "panel_speedup": round(us["onednn"] / us["panel"], 3), "max_rel_difference": error}
            results.append(row)
            print(f"{name:8s} {in_features:5d} x {out_features:5d} rows {rows:5d}: oneDNN {us['onednn']:9.1f} us, "
                  f"panel {us['panel']:9.1f} us ({row['panel_speedup']:.2f}x), panel on 1 thread "
                  f"{us['panel_1_thread']:9.1f} us; GFLOP/s {row['gflops']['onednn']:.0f} / "
                  f"{row['gflops']['panel']:.0f} / {row['gflops']['panel_1_thread']:.0f}", flush=True)
    print(json.dumps({"size": args.size, "threads": args.threads, "gap_us": args.gap_us,
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "results": results}))


if __name__ == "__main__":
    main()
