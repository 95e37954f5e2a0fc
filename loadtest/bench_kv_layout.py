"""The CPU decode kernel at several KV block sizes, with K/V in DRAM: why the engine's CPU default is 128 tokens.

A layer of the pool is [2, num_blocks, KV heads, block_size, D] (kv_cache.layer_shape): each KV head's keys of a
block are one contiguous run of block_size * D floats, which the kernel reads in order. Longer runs keep the
hardware prefetcher streaming; every block boundary is a jump to a block anywhere in the pool. Every block size
gets the same keys, values and queries (the same context per sequence, scattered through shuffled block tables),
so the outputs must agree: the largest difference from the first block size's output is reported (float32
rounding only). --layers layers' worth of K/V are walked per round so that little of it is still in cache.
Median of --rounds, in ms per layer and GB/s of K/V read. Ends with one JSON line.

    python loadtest/bench_kv_layout.py --size small --block-sizes 16 128

The layout itself was chosen with this benchmark's earlier form (commit bc80532), which compared the token-major
layout [2, num_blocks, block_size, KV heads, D] the engine had then against this one (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# As bench_engine.py and the `flotilla` command's workers (before torch loads OpenMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from flotilla.engine.model import decode_kernel  # noqa: E402
from flotilla.engine.model.kv_cache import layer_shape, token_major  # noqa: E402

LAYOUTS = {"tiny": (8, 4, 32), "small": (12, 4, 64)}  # query heads, KV heads, head size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(LAYOUTS), nargs="+", default=["small", "tiny"])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--layers", type=int, default=12, help="layers of K/V walked per round (12: 630 MB for small)")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=400, help="tokens of context per sequence")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.block_sizes + [args.layers, args.seqs, args.context, args.rounds, args.threads]) < 1:
        p.error("every count must be >= 1")
    return args


def paged(context_kv: torch.Tensor, block_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """context_kv [2, seqs, context, KV heads, D] scattered into a pool of `block_size`-token blocks through
    shuffled block tables: (the layer's cache, block tables [seqs, W])."""
    _, num_seqs, context, num_kv_heads, head_dim = context_kv.shape
    width = -(-context // block_size)
    num_blocks = num_seqs * width + 8
    cache = torch.zeros(layer_shape(num_blocks, block_size, num_kv_heads, head_dim))
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * width].view(num_seqs, width).contiguous()
    by_token = token_major(cache)  # [2, blocks, block_size, KV heads, D]
    positions = torch.arange(context)
    for seq in range(num_seqs):
        by_token[:, tables[seq, positions // block_size], positions % block_size] = context_kv[:, seq]
    return cache, tables


def measure(size: str, block_sizes: list[int], args: argparse.Namespace) -> list[dict]:
    num_heads, num_kv_heads, head_dim = LAYOUTS[size]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(args.seqs, num_heads, head_dim, generator=generator)
    context_lens = torch.full((args.seqs,), args.context, dtype=torch.int64)
    contexts = [torch.randn(2, args.seqs, args.context, num_kv_heads, head_dim, generator=generator)
                for _ in range(args.layers)]
    layer_bytes = 2 * args.seqs * args.context * num_kv_heads * head_dim * 4
    results, first_out = [], None
    for block_size in block_sizes:
        layers = [paged(context, block_size, generator) for context in contexts]
        out = torch.empty_like(q)
        seconds = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for cache, tables in layers:
                decode_kernel.paged_decode_attention(q, cache, tables, context_lens, out=out)
            seconds.append((time.perf_counter() - started) / args.layers)
        first_out = out.clone() if first_out is None else first_out
        median = statistics.median(seconds)
        results.append({"size": size, "block_size": block_size, "ms_per_layer": round(median * 1e3, 3),
                        "gb_s": round(layer_bytes / median / 1e9, 1),
                        "max_abs_difference": float((out - first_out).abs().max())})
        del layers
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if decode_kernel.load() is None:
        print("the engine's decode kernel cannot be built here (no C compiler?)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results = []
    for size in args.size:
        for result in measure(size, args.block_sizes, args):
            results.append(result)
            print(f"{size:5s} block {result['block_size']:4d}: {result['ms_per_layer']:.2f} ms per layer "
                  f"({result['gb_s']} GB/s), max |diff| from block {args.block_sizes[0]} "
                  f"{result['max_abs_difference']:.1e}", flush=True)
    print(json.dumps({"threads": args.threads, "layers": args.layers, "seqs": args.seqs, "context": args.context,
                      "rounds": args.rounds, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
