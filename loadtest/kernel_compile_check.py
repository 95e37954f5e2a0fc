"""Compile the engine's Triton attention kernels for NVIDIA GPUs on this machine, without a GPU (`make kernel-check`).

Every launch the engine makes, for each shape in loadtest/common/triton_aot.py (the device check's Llama 1B and 8B,
and the corners of GQA padding, head dims and windows), each dtype pair (bf16, fp16, an fp8 cache, fp32) and each
kind of step (decode, split decode, prefill), is compiled to a cubin for each --arch, as a launch on that GPU would
specialise it. Per launch: shared memory against the architecture's limit, registers, bytes spilled to local memory,
tensor-core instructions, copy sizes, and how many compiles its kind of step costs as block tables widen. A compile
error or shared memory past the limit is a problem (the GPU would refuse the launch) and the command exits 1; spills
are listed apart (the launch runs, slower). One JSON line at the end:
{"problems": [...], "spilled": [...], "launches": [...]}.

    python loadtest/kernel_compile_check.py                  # sm_90 (H100/H200) and sm_80 (A100)
    python loadtest/kernel_compile_check.py --arch 90 --shape llama-8b --dtype bfloat16

This says a kernel builds and fits; how fast it runs only a GPU tells (`make gpu-check`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if os.environ.get("TRITON_INTERPRET") == "1":  # must be decided before triton is imported
    sys.exit("kernel_compile_check: unset TRITON_INTERPRET (the interpreter gives nothing to compile)")

from loadtest.common import triton_aot  # noqa: E402 - after the TRITON_INTERPRET check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, action="append", choices=sorted(triton_aot.SHARED_MEMORY_LIMIT),
                        help="compute capability x 10 (repeatable; default 90 and 80)")
    parser.add_argument("--shape", action="append", choices=[shape.name for shape in triton_aot.SHAPES],
                        help="only these shapes (repeatable; default all)")
    parser.add_argument("--dtype", action="append", help="only dtype pairs whose activation dtype is this "
                        "(bfloat16, float16, float32; repeatable; default all)")
    parser.add_argument("--quiet", action="store_true", help="no line per launch on stderr")
    args = parser.parse_args(argv)
    shapes = [shape for shape in triton_aot.SHAPES if not args.shape or shape.name in args.shape]
    dtypes = [pair for pair in triton_aot.DTYPES if not args.dtype or str(pair[0]).removeprefix("torch.") in args.dtype]

    def progress(launch: dict) -> None:
        if not args.quiet:
            print(json.dumps(launch), file=sys.stderr, flush=True)

    launches = []
    for arch in args.arch or (90, 80):
        launches += triton_aot.compile_matrix(arch, shapes, dtypes, progress=progress)
    found = triton_aot.problems(launches)
    print(json.dumps({"problems": found, "spilled": triton_aot.spilled(launches), "launches": launches}))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
