"""The CPU prefill-attention kernel (csrc/paged_prefill_attention.c): each prefill chunk of a step (one sequence's
queries) against its keys read in place through its block table, causal, flash order; a layer calls it once for
all of the step's chunks. Built and loaded like the decode kernel
(kernel_build.py); where it cannot be built or does not apply (GPU, 16-bit K/V, head size not a multiple of 8),
attention uses the torch path (block gather + SDPA)."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from flotilla.engine.model.decode_kernel import CFLAGS
from flotilla.engine.model.kernel_build import CSRC, KernelLibrary
from flotilla.engine.model.kv_cache import layer_dims

SOURCE = CSRC / "paged_prefill_attention.c"


def _declare(library: ctypes.CDLL) -> None:
    library.paged_prefill_attention_batch_f32.restype = ctypes.c_int
    library.paged_prefill_attention_batch_f32.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]  # q, stride, kv, tables
        + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]  # starts, row offsets, counts, chunks, out
        + [ctypes.c_int64] * 5  # heads, KV heads, head size, pool blocks, block size
        + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int]  # scale, window, softcap, threads
    )


_library = KernelLibrary(SOURCE.name, CFLAGS, _declare)


def load() -> ctypes.CDLL | None:
    return _library.load()


def applies(kv_cache: torch.Tensor) -> bool:
    return (kv_cache.device.type == "cpu" and kv_cache.dtype == torch.float32 and kv_cache.shape[-1] % 8 == 0
            and load() is not None)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    out: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D] (rows may be strided: a slice of the fused qkv) of one sequence's queries at positions
    start..start+T-1 -> out [T, H, D] (contiguous float32, written in place); kv_cache [2, num_blocks,
    H_kv, block_size, D] already holding this chunk's K/V; block_table [W] int64 covering start + T tokens."""
    chunk = PrefillBatch.build(block_table[None], [start], [0], [q.shape[0]])
    return paged_prefill_attention_batch(q, kv_cache, chunk, out, scale, window, softcap)


def paged_prefill_attention_batch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: PrefillBatch,
    out: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Every prefill chunk of a step in one call (one OpenMP region, work spread over all the chunks' tiles):
    q [T, H, D] (rows may be strided) and out [T, H, D] (contiguous float32) hold the whole step's rows; chunk c
    is rows chunks.row_offsets[c].. of them, as paged_prefill_attention describes."""
    _, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if out.shape != q.shape or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} float32 tensor, got {tuple(out.shape)}")
    num_blocks, num_kv_heads, block_size, _ = layer_dims(kv_cache)
    status = load().paged_prefill_attention_batch_f32(
        q.data_ptr(), q.stride(0), kv_cache.data_ptr(), chunks.tables.data_ptr(), chunks.tables.shape[1],
        chunks.starts.data_ptr(), chunks.row_offsets.data_ptr(), chunks.counts.data_ptr(), chunks.starts.shape[0],
        out.data_ptr(), num_heads, num_kv_heads, head_dim, num_blocks, block_size,
        head_dim ** -0.5 if scale is None else scale, window or 0, softcap or 0.0, torch.get_num_threads(),
    )  # fmt: skip
    _check(status, num_heads, num_kv_heads, head_dim)
    return out


class PrefillBatch(NamedTuple):
    """The prefill chunks of a step for paged_prefill_attention_batch: int64 CPU tensors, contiguous."""

    tables: torch.Tensor  # [N, W] each chunk's block table (padded)
    starts: torch.Tensor  # [N] position of each chunk's first query
    row_offsets: torch.Tensor  # [N] its first row in q and out
    counts: torch.Tensor  # [N] its number of queries

    @classmethod
    def build(cls, tables: torch.Tensor, starts: list[int], row_offsets: list[int], counts: list[int]) -> PrefillBatch:
        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return cls(tables.to(torch.int64).contiguous(), column(starts), column(row_offsets), column(counts))


def _check(status: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if status != 0:
        raise RuntimeError(f"prefill kernel failed ({status}) for {num_heads} heads, {num_kv_heads} KV heads of "
                           f"{head_dim}")
