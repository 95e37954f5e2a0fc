"""Compile the engine's Triton attention kernels for an NVIDIA architecture on a machine without a GPU.

Triton's interpreter (what the tests run the kernels under) accepts programs the real compiler refuses, and says
nothing of what a program costs on a GPU: shared memory past the device's limit fails only at launch, and registers
spilled to local memory slow every tile, and a specialisation by value that changes from step to step is a compile
on the serving path. This module runs the engine's own attention call (its metadata, `attention.paged_attention`)
on small CPU tensors shaped like a model's, with the kernels swapped for recorders, then feeds each recorded launch
through Triton's own argument specialisation (alignment and divisibility, as a launch on a GPU would see them) and
compiles it all the way to a cubin with the ptxas that ships in the triton wheel. Nothing runs; only the compile
does.

Must be imported with TRITON_INTERPRET unset: under the interpreter `triton.jit` gives no compilable function, and
triton_attention picks its interpreter tile sizes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from flotilla.engine.config import DEFAULT_BLOCK_SIZE, FP8_MIN_CAPABILITY
from flotilla.engine.model import attention, triton_attention
from flotilla.engine.model.attention import AttentionMetadata, SeqChunk
from flotilla.engine.model.kv_cache import layer_shape

# Shared memory a block may use (opt-in maximum, bytes), from the CUDA programming guide's table per capability
# (100: B200/GB200, compiled with the wheel's ptxas-blackwell).
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
GPU_BLOCK_SIZE = DEFAULT_BLOCK_SIZE["cuda"]
CPU = torch.device("cpu")
H100_MULTIPROCESSORS = 132
# Context lengths a step kind is recorded at: their block tables are 1, 16 and 19 blocks wide (1,024, 2,048 and
# 2,064 tokens: 64, 128 and 129, long enough to split, into 4, 8 and 8 on an H100), the widths Triton would
# specialise differently (1, a multiple of 16, anything else) if the launch let it, each variant a compile on the
# serving path. A prefill of 16 is a whole prompt.
CONTEXT_LENS = {"decode": (16, 256, 300), "decode-split": (1024, 2048, 2064), "prefill": (16, 256, 300)}


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
    """Kernels swapped for recorders, and the launcher told it runs on an H100 (132 multiprocessors), so that it
    splits decode steps as it would there."""
    with contextlib.ExitStack() as patches:
        for name in ("_paged_attention_kernel", "_combine_splits_kernel"):
            patches.enter_context(mock.patch.object(triton_attention, name,
                                                    _Recorder(getattr(triton_attention, name), launches)))
        patches.enter_context(mock.patch.object(triton_attention, "_num_multiprocessors",
                                                lambda device: H100_MULTIPROCESSORS))
        yield


def step_launches(shape: AttentionShape, dtype: torch.dtype, kv_dtype: torch.dtype, phase: str,
                  context_len: int | None = None) -> list[Launch]:
    """The kernel launches the engine makes for one step of `phase` on this shape: 4 sequences of context_len keys
    (default: the phase's longest in CONTEXT_LENS); one query each for decode, for prefill the last 64 (a chunk after
    a prefix hit) or all of them when fewer. Through the engine's own metadata (AttentionMetadata.build) and
    attention call (attention.paged_attention)."""
    context_len = context_len or CONTEXT_LENS[phase][-1]
    num_seqs = 4
    query_len = min(64, context_len) if phase == "prefill" else 1
    blocks_per_seq = -(-context_len // GPU_BLOCK_SIZE)
    seqs = [SeqChunk(context_len - query_len, query_len, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
            for i in range(num_seqs)]
    meta = AttentionMetadata.build(seqs, GPU_BLOCK_SIZE, CPU, sliding_window=shape.window, use_triton=True)
    tokens = num_seqs * query_len
    q = torch.zeros(tokens, shape.num_heads, shape.head_dim, dtype=dtype)
    k = torch.zeros(tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype)
    kv_cache = torch.zeros(layer_shape(num_seqs * blocks_per_seq, GPU_BLOCK_SIZE, shape.num_kv_heads, shape.head_dim),
                           dtype=kv_dtype)
    launches: list[Launch] = []
    with _recording(launches):
        attention.paged_attention(q, k, k, kv_cache, meta, window=shape.window, softcap=shape.softcap)
    splits = launches[0].kwargs["num_splits"]
    if (splits > 1) != (phase == "decode-split"):
        raise RuntimeError(f"{shape.name} {phase} at {context_len} keys: the launcher chose {splits} splits")
    return launches


def warm_up_launches(shape: AttentionShape, dtype: torch.dtype, kv_dtype: torch.dtype) -> list[Launch]:
    """The launches the engine's start-up warm-up (triton_attention.warm_up, run by ModelRunner on CUDA) makes for a
    model of this shape, on a layer cache laid out as the engine's."""
    kv_cache = torch.zeros(layer_shape(4, GPU_BLOCK_SIZE, shape.num_kv_heads, shape.head_dim), dtype=kv_dtype)
    launches: list[Launch] = []
    with _recording(launches):
        triton_attention.warm_up(kv_cache, shape.num_heads, dtype, [(shape.window, shape.softcap)])
    return launches


@functools.cache
def _backend(arch: int):
    return make_backend(GPUTarget("cuda", arch, 32))


def _specialise(launch: Launch, backend) -> tuple:
    """What Triton compiles a launch as on that backend's GPU: (options, signature, constexprs, attrs)."""
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    return kernel._pack_args(backend, launch.kwargs, bound_args, specialization, options)


def _ptxas_usage(ptx: str, backend, options) -> dict:
    """Registers and spill bytes per thread: the backend's own ptxas step run again on the compiled PTX, with its
    own flags (they differ between Triton versions), its `-v` log captured (TRITON_DUMP_PTXAS_LOG)."""
    with mock.patch.dict(os.environ, {"TRITON_DUMP_PTXAS_LOG": "1"}), \
            contextlib.redirect_stdout(io.StringIO()) as captured:
        backend.make_cubin(ptx, {}, options, backend.target.arch)
    log = captured.getvalue()
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "spill_load_bytes": int(spills.group(2)) if spills else 0,
    }


def _ptx_instructions(ptx: str) -> dict:
    """What the PTX says of the inner loop: matrix instructions on the tensor cores (Blackwell's tcgen05.mma,
    Hopper's wgmma, or mma.sync; none for fp32 in IEEE precision, which must not become TF32), and the sizes of the
    asynchronous copies into shared memory (16 bytes: K/V rows loaded as vectors; 8: the block table's int64
    entries) -> {size: count}."""
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*\], \[[^\]]*\], (0x[0-9a-f]+|\d+)", ptx)
    return {
        "tensor_core_instructions": len(re.findall(r"\btcgen05\.mma\b|\bwgmma\.mma_async\b|\bmma\.sync\b", ptx)),
        "async_copy_bytes": {str(int(size, 0)): sizes.count(size) for size in sorted(set(sizes), key=sizes.index)},
    }


def compile_launch(launch: Launch, arch: int) -> dict:
    """Compile one recorded launch for sm_<arch> as a launch on that GPU would: the same specialisation of its
    arguments, the same default options. -> shared memory, warps, registers, spills, matrix instructions and copy
    sizes."""
    backend = _backend(arch)
    options, signature, constexprs, attrs = _specialise(launch, backend)
    compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=backend.target,
                              options=options.__dict__)
    shared = compiled.metadata.shared
    return {
        "kernel": launch.kernel.fn.__name__,
        "shared_bytes": shared,
        "shared_fits": shared <= SHARED_MEMORY_LIMIT[arch],
        "num_warps": compiled.metadata.num_warps,
        "num_stages": compiled.metadata.num_stages,
        **_ptxas_usage(compiled.asm["ptx"], backend, options),
        **_ptx_instructions(compiled.asm["ptx"]),
    }


def _variant_key(launch: Launch, arch: int) -> str:
    """What tells one compile of a kernel from another (Triton's cache key, less the source's hash)."""
    options, signature, constexprs, attrs = _specialise(launch, _backend(arch))
    return repr((launch.kernel.fn.__name__, str(options), signature, sorted(constexprs.items()), sorted(attrs.items())))


def compile_matrix(arch: int, shapes=SHAPES, dtypes=DTYPES, phases=PHASES,
                   progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Every kernel of every (shape, dtypes, phase), compiled for sm_<arch>, one row each. Each step kind is recorded
    at the CONTEXT_LENS; `variants` is how many distinct compiles of that kernel they would cost (1: the table's
    width changes nothing), `compiled_while_serving` how many of those the start-up warm-up leaves to the first
    requests (0: it compiled them all). A compile that fails is a row with its error, not an exception."""
    rows = []
    for shape in shapes:
        for dtype, kv_dtype in dtypes:
            if kv_dtype.itemsize == 1 and (arch // 10, arch % 10) < FP8_MIN_CAPABILITY:
                continue  # the engine refuses an fp8 cache there (config.resolve_kv_cache_dtype)
            warmed = {_variant_key(launch, arch) for launch in warm_up_launches(shape, dtype, kv_dtype)}
            for phase in phases:
                where = {"arch": arch, "shape": shape.name, "dtype": str(dtype).removeprefix("torch."),
                         "kv_dtype": str(kv_dtype).removeprefix("torch."), "phase": phase}
                steps = [step_launches(shape, dtype, kv_dtype, phase, length) for length in CONTEXT_LENS[phase]]
                for kernel_launches in zip(*steps):  # the same kernel at each context length
                    launch = kernel_launches[-1]  # the widest table, of a width Triton has nothing to say about
                    try:
                        keys = {_variant_key(each, arch) for each in kernel_launches}
                        row = {**where, **compile_launch(launch, arch), "variants": len(keys),
                               "compiled_while_serving": len(keys - warmed)}
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
