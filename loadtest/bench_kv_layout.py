"""The CPU decode kernel on the engine's K/V layout against a candidate layout, with K/V in DRAM.

The engine's layer is [2, num_blocks, block_size, KV heads, D] (a token's heads side by side); the candidate
(`loadtest/kv_layout/paged_decode_head_major.c`, built here, not used by the engine) is [2, num_blocks, KV heads,
block_size, D], each KV head's rows of a block contiguous, as vLLM's CPU attention reads them. Both kernels get
the same keys and values (the candidate's a permuted copy), the same shuffled block tables and the same queries;
--layers layers' worth of K/V are walked per round so that little of it is still in cache. Median of --rounds, in
ms per layer and GB/s of K/V read; the largest difference between the two outputs is reported (float32 rounding).
Ends with one JSON line.

    python loadtest/bench_kv_layout.py --size small --block-sizes 16 128
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# As bench_engine.py and the `flotilla` command's workers (before torch loads OpenMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from flotilla.engine.model import decode_kernel  # noqa: E402
from flotilla.engine.model.kernel_build import CSRC, c_compiler  # noqa: E402

CANDIDATE = Path(__file__).resolve().parent / "kv_layout" / "paged_decode_head_major.c"
LAYOUTS = {"tiny": (8, 4, 32), "small": (12, 4, 64)}  # query heads, KV heads, head size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(LAYOUTS), nargs="+", default=["small", "tiny"])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--layers", type=int, default=12, help="layers of K/V walked per round (12: 630 MB for small)")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=400, help="tokens of context per sequence")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.block_sizes + [args.layers, args.seqs, args.context, args.rounds, args.threads]) < 1:
        p.error("every count must be >= 1")
    return args


def build_candidate(directory: str):
    library = Path(directory) / "paged_decode_head_major.so"
    subprocess.run([c_compiler(), *decode_kernel.CFLAGS, "-I", str(CSRC), str(CANDIDATE), "-o", str(library), "-lm"],
                   check=True)
    function = ctypes.CDLL(str(library)).paged_decode_attention_head_major_f32
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
    return function


def compare(candidate, size: str, block_size: int, args: argparse.Namespace) -> dict:
    num_heads, num_kv_heads, head_dim = LAYOUTS[size]
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.seqs * blocks_per_seq + 8
    engine_layers = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
                     for _ in range(args.layers)]
    candidate_layers = [layer.permute(0, 1, 3, 2, 4).contiguous() for layer in engine_layers]
    tables = [torch.randperm(num_blocks, generator=generator)[: args.seqs * blocks_per_seq].view(args.seqs, -1)
              .contiguous() for _ in range(args.layers)]  # fmt: skip
    context_lens = torch.full((args.seqs,), args.context, dtype=torch.int64)
    q = torch.randn(args.seqs, num_heads, head_dim, generator=generator)
    engine_out, candidate_out = torch.empty_like(q), torch.empty_like(q)

    def run_engine() -> None:
        for layer, table in zip(engine_layers, tables):
            decode_kernel.paged_decode_attention(q, layer, table, context_lens, out=engine_out)

    def run_candidate() -> None:
        for layer, table in zip(candidate_layers, tables):
            status = candidate(q.data_ptr(), layer.data_ptr(), table.data_ptr(), context_lens.data_ptr(),
                               candidate_out.data_ptr(), args.seqs, num_heads, num_kv_heads, head_dim, num_blocks,
                               block_size, table.shape[1], head_dim ** -0.5, args.threads)  # fmt: skip
            if status != 0:
                raise RuntimeError(f"the candidate kernel failed ({status})")

    timings: dict[str, list[float]] = {"engine": [], "candidate": []}
    for _ in range(args.rounds):  # interleaved, so that the VM's drift falls on both
        for name, run in (("engine", run_engine), ("candidate", run_candidate)):
            started = time.perf_counter()
            run()
            timings[name].append((time.perf_counter() - started) / args.layers)
    layer_bytes = 2 * args.seqs * args.context * num_kv_heads * head_dim * 4
    result = {"size": size, "block_size": block_size,
              "max_abs_difference": float((engine_out - candidate_out).abs().max())}
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        result[f"{name}_ms_per_layer"] = round(median * 1e3, 3)
        result[f"{name}_gb_s"] = round(layer_bytes / median / 1e9, 1)
    result["candidate_speedup"] = round(result["engine_ms_per_layer"] / result["candidate_ms_per_layer"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if decode_kernel.load() is None:
        print("the engine's decode kernel cannot be built here (no C compiler?)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="kv-layout-") as directory:
        candidate = build_candidate(directory)
        for size in args.size:
            for block_size in args.block_sizes:
                result = compare(candidate, size, block_size, args)
                results.append(result)
                print(f"{size:5s} block {block_size:4d}: engine {result['engine_ms_per_layer']:.2f} ms "
                      f"({result['engine_gb_s']} GB/s), head-major {result['candidate_ms_per_layer']:.2f} ms "
                      f"({result['candidate_gb_s']} GB/s), x{result['candidate_speedup']}, "
                      f"max |diff| {result['max_abs_difference']:.1e}", flush=True)
    print(json.dumps({"threads": args.threads, "layers": args.layers, "seqs": args.seqs, "context": args.context,
                      "rounds": args.rounds, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
