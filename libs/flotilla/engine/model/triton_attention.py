"""Paged attention in one Triton kernel for a whole step: decode rows, prefill chunks and chunked prefill after a
prefix hit, all reading K/V in place through the block tables (no gather into contiguous tensors).

One program per (sequence, block of BLOCK_M query tokens, KV head). Its rows are the BLOCK_M tokens times the
GROUP query heads sharing that KV head (GQA without repeating K/V), padded to powers of two; head dims that are
not a power of two are masked. Keys are walked in tiles of BLOCK_N logical positions, each key's slot looked up
in the block table, so any block size works. Softmax is online in float32 (flash attention); fp32 inputs multiply
in IEEE precision (not TF32), so an fp32 engine stays exact against transformers. K/V may be stored in a narrower
type than q (fp8): they are widened on load.

Split-K decode (flash decoding): an all-decode step with too few (sequence, KV head) programs to fill the GPU and
long enough contexts splits each sequence's keys (those its window leaves it) into `num_splits` equal runs of whole
tiles, one program each. Each program writes its rows' unnormalised output, running max and sum for its run, and a
second kernel combines the runs (weights exp(max_s - max)). Without it a batch-1 decode over a long context runs
num_kv_heads programs on a GPU with 100+ multiprocessors. A CUDA graph picks its split count for the longest context
its block tables hold (cuda_graphs.py); every replay divides each sequence's actual keys among those splits.

Set TRITON_INTERPRET=1 before this module is imported to run the kernel on a CPU (the tests do).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from flotilla.engine.model.kv_cache import layer_dims

# Rows per program (query tokens x the heads of a group) and key positions per tile (tile_sizes). On a GPU tl.dot
# needs M >= 16; the interpreter runs every padded row as numpy work, so it gets the smallest tiles.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DECODE_ROWS = 1 if _INTERPRETED else 16
INTERPRETED_PREFILL_ROWS = INTERPRETED_BLOCK_N = 16
# Split-K decode: aim at twice as many programs as the GPU has multiprocessors, never fewer than MIN_SPLIT_KEYS keys
# a split at the step's longest context (a split's fixed cost: its rows' loads and the combine's reads; shorter
# sequences of the step get shorter runs), at most MAX_SPLITS splits.
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 16
COMBINE_SPLITS_PAD = triton.next_power_of_2(MAX_SPLITS)


# A launch's integer arguments are specialised by value (1, a multiple of 16, anything else), each variant a compile
# on first use. The block table's row stride (the step's widest table, in blocks) and the split count change from
# step to step: specialised, a server would compile up to three variants of each kind of step while serving
# (loadtest/kernel_compile_check.py counts them), for nothing (they only index).
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    scale, softcap, window, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    part_out_ptr, part_ml_ptr, num_splits, SPLIT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    if SPLIT:  # a split step is all decode: one query block, and axis 1 numbers the splits
        q_block = 0
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = context_len - query_len  # position of the chunk's first query token

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = q_block * BLOCK_M + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (token < query_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_offsets = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    query_pos = first_pos + token

    # Keys the block's queries can see: up to its last query (causal), from its first query's window on.
    block_first = q_block * BLOCK_M
    block_last = tl.minimum(block_first + BLOCK_M, query_len) - 1
    kv_end = tl.where(block_first < query_len, first_pos + block_last + 1, 0)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_pos + block_first - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT:  # this program's share of the keys this sequence sees, whole tiles from kv_begin (tiles stay aligned)
        split = tl.program_id(1)
        split_len = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
        kv_begin = kv_begin + split * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    for tile_start in range(kv_begin, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        key_valid = pos < kv_end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=key_valid, other=0)
        slots = block.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_SOFTCAP:  # softcap * tanh(scores / softcap), tanh written with a sigmoid
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        visible = key_valid[None, :] & (pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        m_i = m_new

    if SPLIT:  # the range's unnormalised output, max and sum, for _combine_splits_kernel
        part = ((q_start + token).to(tl.int64) * (GROUP * tl.num_programs(2)) + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_valid[:, None] & dim_valid[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit(do_not_specialize=["num_splits"])  # SPLITS_PAD is always COMBINE_SPLITS_PAD: one compile for any count
def _combine_splits_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """One (token, head): its splits' outputs weighted by exp(max_s - max) over their sums likewise weighted."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    part = (token.to(tl.int64) * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_valid, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=split_valid, other=0.0)
    m_max = tl.max(m, 0)
    weights = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for a split that saw no key
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_valid[:, None] & dim_valid[None, :], other=0.0)
    total = tl.sum(weights * l, 0)
    out = tl.sum(weights[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_valid)


def tile_sizes(head_dim: int, dtype: torch.dtype, decode: bool) -> tuple[int, int]:
    """(rows per program, keys per tile) on a GPU: 64 x 64 while a row of q (its padded head dim) is at most 128
    16-bit values, halved for each doubling past that, so that a program's q, K/V tiles and float32 accumulator stay
    in registers. fp32 q counts four times (fp32 tl.dot runs as FMAs on registers, not on the tensor cores); fp8
    K/V is widened to q's type, so it counts as q. Decode steps keep DECODE_ROWS rows. Measured by compiling every
    launch for sm_80 and sm_90 (loadtest/kernel_compile_check.py): 64 x 64 prefill tiles at head dim 256, or in fp32
    at any head dim, spilled registers (up to 67 KB a thread), and in fp32 at 256 needed more shared memory than an
    A100 has; so did 64-key decode tiles at head dim 256 in fp32."""
    if _INTERPRETED:
        return (DECODE_ROWS if decode else INTERPRETED_PREFILL_ROWS), INTERPRETED_BLOCK_N
    width = max(16, triton.next_power_of_2(head_dim)) * (4 if dtype == torch.float32 else 1)
    tile = 64 if width <= 128 else max(16, 64 * 128 // width)
    return (DECODE_ROWS if decode else tile), tile


def decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_multiprocessors: int) -> int:
    """Splits per (sequence, KV head) for an all-decode step: enough programs for twice the multiprocessors, at
    least MIN_SPLIT_KEYS keys a split at max_context_len, at most MAX_SPLITS; 1 when the step fills the GPU already
    or its contexts are short (or unknown: max_context_len 0)."""
    programs = num_seqs * num_kv_heads
    wanted = -(-2 * num_multiprocessors // max(programs, 1))
    return max(1, min(wanted, max_context_len // MIN_SPLIT_KEYS, MAX_SPLITS))


@functools.cache
def _num_multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: split only when asked (num_splits)
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    max_context_len: int = 0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] (sequence i's tokens are rows query_start_loc[i]:query_start_loc[i+1], the last ones of its
    context of context_lens[i] keys); kv_cache [2, num_blocks, H_kv, block_size, D] already holding this step's
    K/V; block_tables [num_seqs, W]. -> [T, H, D]. max_query_len (a host int) sizes the grid only.
    max_context_len: the longest context_lens entry, or more (a host int; 0: unknown): what decode_splits sizes an
    all-decode step's splits for. Each sequence divides the keys it sees among the splits itself. num_splits: force
    that many splits of an all-decode step (tests; 1: none)."""
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = layer_dims(kv_cache)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous head dimension")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    rows, block_n = tile_sizes(head_dim, q.dtype, decode=max_query_len == 1)
    block_m = max(1, rows // group_pad)
    out = torch.empty_like(q) if out is None else out
    num_seqs = context_lens.shape[0]
    splits = 1
    if max_query_len == 1:
        splits = num_splits or decode_splits(num_seqs, num_kv_heads, max_context_len, _num_multiprocessors(q.device))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part_out = torch.empty((q.shape[0], num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((q.shape[0], num_heads, splits, 2), dtype=torch.float32, device=q.device)
        grid = (num_seqs, splits, num_kv_heads)
    else:
        part_out, part_ml = out, out  # unused: SPLIT is off
        grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_kv_heads)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), block_tables.stride(0),  # block, token, head
        head_dim ** -0.5 if scale is None else scale, softcap or 1.0, window or 0, block_size,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None,
        part_out_ptr=part_out, part_ml_ptr=part_ml, num_splits=splits, SPLIT=splits > 1,
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(q.shape[0], num_heads)](
            part_out, part_ml, out, out.stride(0), out.stride(1), num_heads, splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=COMBINE_SPLITS_PAD,
        )  # fmt: skip
    return out


def warm_up(kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype,
            layer_kinds: Iterable[tuple[int | None, float | None]]) -> int:
    """Compile, before serving, every variant of the kernels a step can launch on this layer cache: decode, split
    decode and prefill (a mixed step launches the prefill variant), for each (window, soft-cap) the model's layers
    use. Triton compiles a variant at its first launch, a second or more on the GPU's host, so without this the
    first requests of a new worker (a warm pool's too) would wait for it. The launches take what a step's do: q of
    the model's dtype, this cache, int64 tables and lengths (AttentionMetadata); they read block 0 and write only
    their own output. -> the number of launches."""
    _, _, _, head_dim = layer_dims(kv_cache)
    device = kv_cache.device
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    block_table = torch.zeros(1, 1, dtype=torch.int64, device=device)
    context_lens = torch.full((1,), 2, dtype=torch.int64, device=device)
    launches = 0
    for window, softcap in sorted(set(layer_kinds), key=repr):
        for query_len, num_splits in ((1, 1), (1, 2), (2, None)):  # decode, split decode, prefill
            query_start = torch.tensor([0, query_len], dtype=torch.int64, device=device)
            paged_attention(q[:query_len], kv_cache, block_table, query_start, context_lens, query_len,
                            window=window, softcap=softcap, num_splits=num_splits)
            launches += 1
    return launches
