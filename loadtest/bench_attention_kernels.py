"""One layer's paged attention on the CPU as the engine calls it (`paged_attention`, K/V written into the cache
then read back through block tables), the C kernels against the torch path (block gather + SDPA) in the same
run, at the head layouts of the bench models: a prefill step of 4 x 512-token prompts and a decode step of 64
sequences of 300-500 tokens' context. Median of --reps calls each; GFLOP/s counts QK^T and PV over the visible
keys only. Ends with one JSON line.

    python loadtest/bench_attention_kernels.py
    PYTHONPATH=/path/to/other/checkout/libs python loadtest/bench_attention_kernels.py   # that checkout's kernels
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# As bench_engine.py and the `flotilla` command's workers (before torch loads OpenMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from flotilla.engine.model import decode_kernel, prefill_kernel  # noqa: E402
from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention  # noqa: E402
from flotilla.engine.model.kv_cache import layer_shape  # noqa: E402

LAYOUTS = {  # name: (query heads, KV heads, head size)
    "tiny": (8, 4, 32),
    "small": (12, 4, 64),
    "smollm2": (9, 3, 64),
}
BLOCK_SIZE = 16


def prefill_step(rng: random.Random) -> list[tuple[int, int]]:
    """(start, num_tokens) per sequence: four 512-token prompts from position 0, as profile_engine's step."""
    return [(0, 512)] * 4


def decode_step(rng: random.Random) -> list[tuple[int, int]]:
    return [(rng.randrange(300, 500), 1) for _ in range(64)]


def time_layer(chunks: list[tuple[int, int]], layout: tuple[int, int, int], use_kernels: bool, reps: int) -> float:
    """Median seconds of paged_attention over one step of `chunks` (block tables shuffled across the pool)."""
    num_heads, num_kv_heads, head_dim = layout
    generator = torch.Generator().manual_seed(0)
    needed = [-(-(start + count) // BLOCK_SIZE) for start, count in chunks]
    num_blocks = sum(needed) + 8
    order = torch.randperm(num_blocks, generator=generator).tolist()
    seqs, taken = [], 0
    for (start, count), n in zip(chunks, needed):
        seqs.append(SeqChunk(start, count, order[taken:taken + n]))
        taken += n
    kv_cache = torch.randn(layer_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), generator=generator)
    num_tokens = sum(count for _, count in chunks)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, torch.device("cpu"), use_decode_kernel=use_kernels,
                                   use_prefill_kernel=use_kernels)
    for _ in range(2):
        paged_attention(q, k, v, kv_cache, meta)
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        paged_attention(q, k, v, kv_cache, meta)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def attention_flops(chunks: list[tuple[int, int]], num_heads: int, head_dim: int) -> float:
    """QK^T and PV multiply-adds (2 FLOPs each) over the keys each query sees."""
    pairs = sum(count * start + count * (count + 1) // 2 for start, count in chunks)
    return 4.0 * pairs * num_heads * head_dim


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    args = p.parse_args(argv)
    if decode_kernel.load() is None or prefill_kernel.load() is None:
        print("the C kernels cannot be built here (no C compiler, or FLOTILLA_DISABLE_KERNELS)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results = []
    for name in args.layouts:
        layout = LAYOUTS[name]
        for step, make in (("prefill", prefill_step), ("decode", decode_step)):
            chunks = make(random.Random(0))
            flops = attention_flops(chunks, layout[0], layout[2])
            torch_s = time_layer(chunks, layout, use_kernels=False, reps=args.reps)
            kernel_s = time_layer(chunks, layout, use_kernels=True, reps=args.reps)
            row = {"layout": name, "heads": list(layout), "step": step, "kernel_ms": round(kernel_s * 1e3, 3),
                   "torch_ms": round(torch_s * 1e3, 3), "kernel_gflops": round(flops / kernel_s / 1e9, 1),
                   "torch_gflops": round(flops / torch_s / 1e9, 1), "speedup": round(torch_s / kernel_s, 2)}
            results.append(row)
            print(f"{name:8} {step:8} kernel {row['kernel_ms']:8.3f} ms ({row['kernel_gflops']:6.1f} GFLOP/s)   "
                  f"torch {row['torch_ms']:8.3f} ms ({row['torch_gflops']:6.1f} GFLOP/s)   {row['speedup']:.2f}x",
                  flush=True)
    print(json.dumps({"threads": args.threads, "block_size": BLOCK_SIZE, "torch_version": torch.__version__,
                      "loadavg_1m": os.getloadavg()[0], "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
