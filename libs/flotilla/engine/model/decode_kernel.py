"""The CPU decode-attention kernel (csrc/paged_decode_attention.c): built with the system C compiler on
first use, cached by source digest and CPU, called through ctypes (kernel_build.py). Where it cannot be built (no
compiler, FLOTILLA_DISABLE_KERNELS) or does not apply (GPU, 16-bit K/V), attention uses the torch path. Where
the engine's panel matmul loads too (panel_gemm.py), the kernel shares out sequences on that matmul's thread pool,
else in an OpenMP region."""

from __future__ import annotations

import ctypes

import torch

from flotilla.engine.model import panel_gemm
from flotilla.engine.model.kernel_build import CSRC, KernelLibrary
from flotilla.engine.model.kv_cache import layer_dims

CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC"]
SOURCE = CSRC / "paged_decode_attention.c"


def _declare(library: ctypes.CDLL) -> None:
    library.paged_decode_attention_f32.restype = ctypes.c_int
    library.paged_decode_attention_f32.argtypes = [
        ctypes.c_void_p, ctypes.c_int64,  # q and its row stride
        *[ctypes.c_void_p] * 4,  # kv, block tables, context lengths, out
        *[ctypes.c_int64] * 7,  # sequences, heads, KV heads, head size, blocks, block size, table width
        ctypes.c_float,  # scale
        ctypes.c_int64,  # window
        ctypes.c_float,  # softcap
        ctypes.c_int,
    ]
    library.paged_decode_attention_use_pool.restype = None
    library.paged_decode_attention_use_pool.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    share_the_matmul_pool(library)


def share_the_matmul_pool(library: ctypes.CDLL, share: bool = True) -> None:
    """Sequences go out on the panel matmul's thread pool (share) or in an OpenMP region: on the pool, a layer's
    attention finds the worker still spinning from its qkv matmul (csrc/paged_decode_attention.c)."""
    run = panel_gemm.pool_run_address() if share else None
    library.paged_decode_attention_use_pool(run, panel_gemm.SPIN_NS)


_library = KernelLibrary(SOURCE.name, CFLAGS, _declare)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be had on this machine (logged once)."""
    return _library.load()


def applies(kv_cache: torch.Tensor) -> bool:
    return kv_cache.device.type == "cpu" and kv_cache.dtype == torch.float32 and load() is not None


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; kv_cache [2, num_blocks, H_kv, block_size, D]; block_tables [B, W] int64.
    q is read in place when each row's heads are contiguous (a slice of the fused qkv output), else copied.
    scale: of q.k (None: D ** -0.5); window: attend to the last `window` keys only; softcap: tanh soft-cap.
    out: a contiguous [B, H, D] float32 tensor to write into (the layer's output rows: no copy afterwards)."""
    if q.dtype != torch.float32 or kv_cache.dtype != torch.float32:  # the C code reads and writes float32
        raise ValueError(f"the decode kernel takes float32 queries and K/V, got {q.dtype} and {kv_cache.dtype}")
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1] or q.stride(0) < q.shape[1] * q.shape[2]:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or not out.is_contiguous() or out.dtype != q.dtype:
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor, got {tuple(out.shape)}")
    num_blocks, num_kv_heads, block_size, head_dim = layer_dims(kv_cache)
    status = load().paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), kv_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), q.shape[0], q.shape[1], num_kv_heads, head_dim, num_blocks, block_size, block_tables.shape[1],
        head_dim ** -0.5 if scale is None else scale, window or 0, softcap or 0.0, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"decode kernel failed ({status}) for {q.shape[1]} heads, {num_kv_heads} KV heads")
    return out
