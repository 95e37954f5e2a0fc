"""Compile the engine's Triton attention kernels for an NVIDIA architecture on a machine without a GPU.

Triton's interpreter (what the tests run the kernels under) accepts programs the real compiler refuses, and says
nothing of what a program costs on a GPU: shared memory past the device's limit fails only at launch, and registers
spilled to local memory slow every tile. This module runs the engine's own launcher (`paged_attention`) on small
CPU tensors shaped like a model's, with the kernels swapped for recorders, then feeds each recorded launch through
Triton's own argument specialisation (alignment and divisibility, as a launch on a GPU would see them) and compiles
it all the way to a cubin with the ptxas that ships in the triton wheel. Nothing runs; only the compile does.

Must be imported with TRITON_INTERPRET unset: under the interpreter `triton.jit` gives no compilable function, and
triton_attention picks its interpreter tile sizes.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from flotilla.engine.config import FP8_MIN_CAPABILITY
from flotilla.engine.model import triton_attention
from flotilla.engine.model.kv_cache import layer_shape

# Shared memory a block may use (opt-in maximum, bytes), from the CUDA programming guide's table per capability.
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
GPU_BLOCK_SIZE = 16  # config.DEFAULT_BLOCK_SIZE["cuda"]


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention as the kernel sees it."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None
    softcap: float | None = None


# Shapes of the models people serve: the device check's two (Llama 3.2 1B, Llama 3.1 8B), and the corners of the
# kernel's padding and masking (a group of 7 padded to 8, one of 8, no grouping, head dims of 96 and 256, a window
# and a softcap).
SHAPES = (
    AttentionShape("llama-1b", 32, 8, 64),
    AttentionShape("llama-8b", 32, 8, 128),
    AttentionShape("llama-70b", 64, 8, 128),
    AttentionShape("qwen2-7b", 28, 4, 128),
    AttentionShape("llama2-7b", 32, 32, 128),
    AttentionShape("phi3-mini", 32, 32, 96),
    AttentionShape("gemma2-9b", 16, 8, 256, window=4096, softcap=50.0),
)
# (activation dtype, KV-cache dtype): the GPU defaults, fp16, an fp8 cache, and fp32 (the device check's exactness).
DTYPES = (
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
    (torch.float32, torch.float32),
)
# Steps: all decode (one query each), all decode split across the keys (flash decoding), and prefill chunks.
PHASES = ("decode", "decode-split", "prefill")


@dataclass
class Launch:
    kernel: triton.runtime.jit.JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, kernel, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, grid, args, kwargs))


@contextmanager
def _recording(launches: list[Launch]):
    names = ("_paged_attention_kernel", "_combine_splits_kernel")
    originals = {name: getattr(triton_attention, name) for name in names}
    try:
        for name, kernel in originals.items():
            setattr(triton_attention, name, _Recorder(kernel, launches))
        yield
    finally:
        for name, kernel in originals.items():
            setattr(triton_attention, name, kernel)


def step_launches(shape: AttentionShape, dtype: torch.dtype, kv_dtype: torch.dtype, phase: str) -> list[Launch]:
    """The kernel launches paged_attention makes for one step of `phase` on this shape: 4 sequences with 300 keys
    each (one query each for decode, the last 64 for prefill, so a chunk after a prefix hit)."""
    num_seqs, context_len = 4, 300
    query_len = 64 if phase == "prefill" else 1
    blocks_per_seq = -(-context_len // GPU_BLOCK_SIZE)
    qkv = torch.zeros(num_seqs * query_len, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim, dtype=dtype)
    q = qkv[:, : shape.num_heads * shape.head_dim].view(-1, shape.num_heads, shape.head_dim).contiguous()  # rotated
    kv_cache = torch.zeros(layer_shape(num_seqs * blocks_per_seq, GPU_BLOCK_SIZE, shape.num_kv_heads, shape.head_dim),
                           dtype=kv_dtype)
    block_tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    query_start = torch.arange(num_seqs + 1, dtype=torch.int32) * query_len
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32)
    launches: list[Launch] = []
    with _recording(launches):
        triton_attention.paged_attention(
            q, kv_cache, block_tables, query_start, context_lens, query_len, window=shape.window,
            softcap=shape.softcap, max_context_len=context_len, num_splits=4 if phase == "decode-split" else None,
        )  # fmt: skip
    return launches


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes per thread, from `ptxas -v` on the compiled PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        log = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", source,
             "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "spill_load_bytes": int(spills.group(2)) if spills else 0,
    }


def _ptx_instructions(ptx: str) -> dict:
    """What the PTX says of the inner loop: matrix instructions on the tensor cores (Hopper's wgmma, or mma.sync;
    none for fp32 in IEEE precision, which must not become TF32), and the sizes of the asynchronous copies into
    shared memory (16 bytes: K/V rows loaded as vectors; 4: the block table's entries) -> {size: count}."""
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*\], \[[^\]]*\], (0x[0-9a-f]+|\d+)", ptx)
    return {
        "tensor_core_instructions": len(re.findall(r"\bwgmma\.mma_async\b|\bmma\.sync\b", ptx)),
        "async_copy_bytes": {str(int(size, 0)): sizes.count(size) for size in sorted(set(sizes), key=sizes.index)},
    }


def compile_launch(launch: Launch, arch: int) -> dict:
    """Compile one recorded launch for sm_<arch> as a launch on that GPU would: the same specialisation of its
    arguments, the same default options. -> shared memory, warps, registers, spills, matrix instructions and copy
    sizes."""
    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound_args, specialization,
                                                              options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=backend.target,
                              options=options.__dict__)
    shared = compiled.metadata.shared
    return {
        "kernel": kernel.fn.__name__,
        "shared_bytes": shared,
        "shared_fits": shared <= SHARED_MEMORY_LIMIT.get(arch, min(SHARED_MEMORY_LIMIT.values())),
        "num_warps": compiled.metadata.num_warps,
        "num_stages": compiled.metadata.num_stages,
        **_ptxas_usage(compiled.asm["ptx"], arch),
        **_ptx_instructions(compiled.asm["ptx"]),
    }


def compile_matrix(arch: int, shapes=SHAPES, dtypes=DTYPES, phases=PHASES,
                   progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Every launch of every (shape, dtypes, phase), compiled for sm_<arch>. A compile that fails is a row with
    its error, not an exception: the report shows all of them."""
    rows = []
    for shape in shapes:
        for dtype, kv_dtype in dtypes:
            if kv_dtype.itemsize == 1 and (arch // 10, arch % 10) < FP8_MIN_CAPABILITY:
                continue  # the engine refuses an fp8 cache there (config.resolve_kv_cache_dtype)
            for phase in phases:
                where = {"arch": arch, "shape": shape.name, "dtype": str(dtype).removeprefix("torch."),
                         "kv_dtype": str(kv_dtype).removeprefix("torch."), "phase": phase}
                for launch in step_launches(shape, dtype, kv_dtype, phase):
                    try:
                        row = {**where, **compile_launch(launch, arch)}
                    except Exception as error:  # noqa: BLE001 - reported per launch
                        row = {**where, "kernel": launch.kernel.fn.__name__,
                               "error": f"{type(error).__name__}: {str(error)[:500]}"}
                    rows.append(row)
                    if progress:
                        progress(row)
    return rows


def problems(launches: list[dict]) -> list[dict]:
    """The launches a GPU would refuse: a compile error, or more shared memory than the architecture has."""
    found = []
    for launch in launches:
        if "error" in launch:
            found.append({**launch, "problem": "compile error"})
        elif not launch["shared_fits"]:
            found.append({**launch, "problem": "shared memory past the architecture's limit"})
    return found


def spilled(launches: list[dict]) -> list[dict]:
    """The compiled launches that spill registers to local memory: they run, slower."""
    return [launch for launch in launches if launch.get("spill_store_bytes") or launch.get("spill_load_bytes")]
