"""Paged attention: per-step metadata built once, per-layer work is tensor ops only.

Each layer (1) writes every new token's K/V into the cache through `slot_mapping`, then
(2) reads each sequence's whole context back through its block table. Writing first matters:
a sequence may read blocks that another sequence of the same step has just written.
Decode chunks (one token) run batched in SDPA calls over a padded gather with a boolean mask, in groups
of consecutive sequences whose gathered K/V stays small (on a CPU a group that fits the caches runs
4x faster than one big batch; on a GPU one group); prefill chunks run one SDPA call each, causal with
an offset. On a CPU with float32 K/V, C kernels read the blocks in place instead: decode_kernel for one-token
chunks, prefill_kernel for longer ones (flash order, causal from the chunk's offset, windows and soft-caps).
Sliding-window layers use a second mask of each kind (built when the step is given the model's window) that also
hides keys older than the window; the CPU kernel skips them. Soft-capped scores (Gemma 2) leave SDPA for the same
computation written out (scores, tanh cap, mask, softmax, values), since SDPA has no soft-cap.
With the Triton backend (metadata built with use_triton: query_start_loc set, no groups or masks) step (2) is one
kernel for the whole step that reads the blocks in place (triton_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from flotilla.engine.device_copy import to_device
from flotilla.engine.model import decode_kernel, fused_ops, prefill_kernel
from flotilla.engine.model.kv_cache import cache_rows, layer_dims
from flotilla.engine.model.kv_scales import UNIT, KVScales


class SeqChunk(NamedTuple):
    """Tokens [start, start + num_tokens) of one sequence are computed this step; block_ids is its block table.

    num_prompt_tokens sets the rope lengths that length-dependent RoPE (LongRoPE, dynamic NTK) picks frequencies
    by: the request's prompt length as first submitted gives what transformers' `generate` computes (all prompt
    tokens in one forward pass of the prompt's length, each later token in a pass of its position + 1), however
    the engine chunks the prompt. None: the context length after this step, as transformers computes a sequence
    fed chunk by chunk."""

    start: int
    num_tokens: int
    block_ids: list[int]
    num_prompt_tokens: int | None = None


@dataclass(frozen=True)
class DecodeBatch:
    """All one-token chunks of a step, attended in one padded SDPA call."""

    token_indices: torch.Tensor  # [B] rows of the flattened input
    token_slice: slice | None  # the same rows as a slice when they are a contiguous run (the usual case)
    block_ids: torch.Tensor  # [B * W] every sequence's block table padded to W blocks (padding: block 0)
    mask: torch.Tensor  # [B, 1, 1, W * block_size] True where the key is inside the sequence's context
    window_mask: torch.Tensor | None = None  # the same, less keys older than the sliding window (None: no window)


@dataclass(frozen=True)
class DecodeRows:
    """All one-token chunks of a step for the CPU kernel, which reads K/V through the block tables."""

    token_indices: torch.Tensor  # [B] rows of the flattened input
    token_slice: slice | None
    block_tables: torch.Tensor  # [B, W] int64, contiguous
    context_lens: torch.Tensor  # [B] int64


@dataclass(frozen=True)
class PrefillChunk:
    """One multi-token chunk: queries at positions start.., keys 0..start+num_tokens-1."""

    token_slice: slice  # its rows of the flattened input
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] the blocks holding its context
    context_len: int
    mask: torch.Tensor | None  # [num_tokens, context_len]; None when start == 0 (plain causal)
    # Sliding layers read only the blocks from the one holding the chunk's oldest visible key (position
    # window_key_start on): window_mask [num_tokens, context_len - window_key_start]; None: plain causal.
    window_mask: torch.Tensor | None = None
    window_block_ids: torch.Tensor | None = None
    window_key_start: int = 0


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [T] position of every new token (the same values the runner passes)
    slot_mapping: torch.Tensor  # [T] cache slot (block_id * block_size + offset) of every new token
    context_lens: torch.Tensor  # [num_seqs] context length after the step
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded with 0 past each table's needed blocks
    decode_groups: tuple[DecodeBatch, ...]
    prefills: tuple[PrefillChunk, ...]
    decode_rows: DecodeRows | None = None  # set instead of decode_groups when the CPU kernel runs decode
    # Set when the CPU prefill kernel runs the prefill chunks (one call per layer; it reads blocks in place, so
    # `prefills` then carries no masks)
    prefill_batch: prefill_kernel.PrefillBatch | None = None
    rope_lens: torch.Tensor | None = None  # [T] the rope length of each token (SeqChunk.num_prompt_tokens)
    max_rope_len: int = 0  # their maximum
    sliding_window: int | None = None  # the window the window masks were built for
    # Set (and decode_groups/prefills left empty) when the Triton kernel runs the whole step (triton_attention.py)
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] each sequence's first row in the input
    max_query_len: int = 0
    # The longest context of the step, or more (a CUDA graph's: what its tables hold); 0: unknown
    max_context_len: int = 0
    # [T * H_kv] where each new token's K/V rows go (kv_cache.cache_rows): set once per forward (with_cache_rows),
    # since every layer's cache has the same shape; None: paged_attention computes them
    cache_rows: torch.Tensor | None = None

    def with_cache_rows(self, kv_cache: torch.Tensor) -> AttentionMetadata:
        return replace(self, cache_rows=cache_rows(self.slot_mapping, kv_cache))

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqChunk],
        block_size: int,
        device: torch.device,
        max_decode_group_tokens: int | None = None,
        use_decode_kernel: bool = False,
        sliding_window: int | None = None,
        use_triton: bool = False,
        use_prefill_kernel: bool = False,
    ) -> AttentionMetadata:
        """max_decode_group_tokens caps the padded context tokens gathered per decode SDPA call; None picks
        a per-device default. Order decode chunks by context length to keep padding small.
        use_decode_kernel: decode through the CPU kernel (decode_kernel.applies) instead of SDPA groups.
        sliding_window: the model's (ModelConfig.sliding_window), for the masks of its sliding layers.
        use_triton: the Triton kernel reads the whole step through block_tables; no masks or groups are built.
        use_prefill_kernel: multi-token chunks through the CPU prefill kernel (prefill_kernel.applies), which
        reads their blocks in place and masks as it goes: no gather, no masks built."""
        _validate(seqs, block_size, sliding_window)
        starts = [seq.start for seq in seqs]
        counts = [seq.num_tokens for seq in seqs]
        ends = [start + count for start, count in zip(starts, counts)]
        offsets = _exclusive_cumsum(counts)
        # Per-token indices in numpy on the host, then one copy each to the device: a step's metadata is a few
        # dozen small arrays, and torch's per-op cost (~5-10 us on a CPU) outweighed the arithmetic.
        table_rows = _block_table_rows(seqs, ends, block_size)
        seq_of_token = np.repeat(np.arange(len(seqs)), counts)
        positions_host = np.arange(len(seq_of_token), dtype=np.int64) + (np.asarray(starts) - offsets)[seq_of_token]
        slots = table_rows[seq_of_token, positions_host // block_size] * block_size + positions_host % block_size
        block_tables = to_device(table_rows, device)
        positions = to_device(positions_host, device)
        context_lens = to_device(ends, device, torch.int64)
        decode_ids = [i for i, count in enumerate(counts) if count == 1 and not use_triton]
        decode_rows = None
        decode_groups: tuple[DecodeBatch, ...] = ()
        if use_decode_kernel and decode_ids:
            decode_rows = _decode_rows(decode_ids, offsets, ends, table_rows, device)
        else:
            group_tokens = max_decode_group_tokens or _default_decode_group_tokens(device)
            decode_groups = tuple(
                _decode_batch(group, offsets, ends, block_tables, block_size, device, sliding_window)
                for group in _decode_groups(decode_ids, ends, group_tokens)
            )
        prefill_ids = [i for i, count in enumerate(counts) if count > 1 and not use_triton]
        prefills = tuple(
            _prefill_chunk(starts[i], counts[i], offsets[i], block_tables[i], block_size, device, sliding_window,
                           masks=not use_prefill_kernel)
            for i in prefill_ids
        )
        prefill_batch = None
        if use_prefill_kernel and prefill_ids:
            prefill_batch = prefill_kernel.PrefillBatch.build(
                block_tables[prefill_ids], [starts[i] for i in prefill_ids], [offsets[i] for i in prefill_ids],
                [counts[i] for i in prefill_ids])
        # rope length max(floor, position + 1): floor is the prompt length, or the chunk's end when not given
        floors = [end if seq.num_prompt_tokens is None else seq.num_prompt_tokens for seq, end in zip(seqs, ends)]
        rope_lens = np.maximum(np.asarray(floors, dtype=np.int64)[seq_of_token], positions_host + 1)
        return cls(
            num_tokens=sum(counts),
            positions=positions,
            slot_mapping=to_device(slots, device),
            context_lens=context_lens,
            block_tables=block_tables,
            decode_groups=decode_groups,
            decode_rows=decode_rows,
            prefill_batch=prefill_batch,
            prefills=prefills,
            rope_lens=to_device(rope_lens, device),
            max_rope_len=max(max(floors), max(ends)),
            sliding_window=sliding_window,
            query_start_loc=to_device([*offsets, sum(counts)], device, torch.int64)
            if use_triton else None,
            max_query_len=max(counts),
            max_context_len=max(ends),
        )


def _validate(seqs: Sequence[SeqChunk], block_size: int, sliding_window: int | None) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if not seqs:
        raise ValueError("a step needs at least one sequence chunk")
    for seq in seqs:
        if seq.start < 0 or seq.num_tokens < 1:
            raise ValueError(f"bad chunk start={seq.start} num_tokens={seq.num_tokens}")
        if len(seq.block_ids) * block_size < seq.start + seq.num_tokens:
            raise ValueError(
                f"block table of {len(seq.block_ids)} blocks cannot hold {seq.start + seq.num_tokens} tokens"
            )


def _exclusive_cumsum(counts: list[int]) -> list[int]:
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets


def _block_table_rows(seqs: Sequence[SeqChunk], ends: list[int], block_size: int) -> np.ndarray:
    """[num_seqs, W] int64: only the blocks each context needs (a longer table, blocks reserved ahead, is cut),
    padded with block 0."""
    needed = [-(-end // block_size) for end in ends]
    rows = np.zeros((len(seqs), max(needed)), dtype=np.int64)
    for row, seq, n in zip(rows, seqs, needed):
        row[:n] = seq.block_ids[:n]
    return rows


CPU_DECODE_GROUP_TOKENS = 4096  # ~4 MB of fp32 K/V per group for a 128-wide KV layer: stays in cache


def _default_decode_group_tokens(device: torch.device) -> int:
    return CPU_DECODE_GROUP_TOKENS if device.type == "cpu" else 1 << 62


def _decode_groups(decode_ids: list[int], ends: list[int], max_group_tokens: int) -> list[list[int]]:
    """Consecutive runs of decode sequences whose padded contexts total at most max_group_tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in decode_ids:
        width = max([ends[j] for j in current] + [ends[i]])
        if current and width * (len(current) + 1) > max_group_tokens:
            groups.append(current)
            current = []
        current.append(i)
    return groups + [current] if current else groups


def _decode_rows(decode_ids: list[int], offsets, ends, table_rows: np.ndarray, device) -> DecodeRows:
    rows = [offsets[i] for i in decode_ids]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeRows(
        token_indices=to_device(rows, device, torch.int64),
        token_slice=slice(rows[0], rows[0] + len(rows)) if contiguous else None,
        block_tables=to_device(table_rows[decode_ids], device),
        context_lens=to_device([ends[i] for i in decode_ids], device, torch.int64),
    )


def _decode_batch(decode_ids: list[int], offsets, ends, block_tables, block_size, device, window) -> DecodeBatch:
    rows = [offsets[i] for i in decode_ids]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    max_context_len = max(ends[i] for i in decode_ids)
    width = -(-max_context_len // block_size)
    ids = to_device(decode_ids, device, torch.int64)
    context_lens = to_device([ends[i] for i in decode_ids], device, torch.int64)
    key_positions = torch.arange(width * block_size, dtype=torch.int64, device=device)
    mask = (key_positions[None, :] < context_lens[:, None])[:, None, None, :]
    window_mask = None
    if window is not None:  # the query sits at context_len - 1 and sees keys from context_len - window on
        recent = key_positions[None, :] >= context_lens[:, None] - window
        window_mask = mask if max_context_len <= window else mask & recent[:, None, None, :]
    return DecodeBatch(
        token_indices=to_device(rows, device, torch.int64),
        token_slice=slice(rows[0], rows[0] + len(rows)) if contiguous else None,
        block_ids=block_tables[ids, :width].reshape(-1),
        mask=mask,
        window_mask=window_mask,
    )


def _prefill_chunk(start, count, offset, block_row, block_size, device, window, masks: bool = True) -> PrefillChunk:
    context_len = start + count
    block_ids = block_row[: -(-context_len // block_size)]
    if not masks:  # the prefill kernel reads the whole table and masks as it goes
        return PrefillChunk(token_slice=slice(offset, offset + count), block_ids=block_ids, context_len=context_len,
                            mask=None)
    mask = None
    if start > 0:
        mask = _causal_mask(0, start, context_len, device)
    window_mask, window_block_ids, window_key_start = mask, block_ids, 0
    if window is not None and context_len > window:
        first_block = max(0, start - window + 1) // block_size  # the oldest key any query of the chunk sees
        window_key_start = first_block * block_size
        window_block_ids = block_ids[first_block:]
        causal = _causal_mask(window_key_start, start, context_len, device)
        key_positions = torch.arange(window_key_start, context_len, dtype=torch.int64, device=device)
        query_positions = torch.arange(start, context_len, dtype=torch.int64, device=device)
        window_mask = causal & (key_positions[None, :] > query_positions[:, None] - window)
    return PrefillChunk(
        token_slice=slice(offset, offset + count),
        block_ids=block_ids,
        context_len=context_len,
        mask=mask,
        window_mask=window_mask,
        window_block_ids=window_block_ids,
        window_key_start=window_key_start,
    )


def _causal_mask(key_start: int, start: int, context_len: int, device) -> torch.Tensor:
    """[context_len - start, context_len - key_start]: queries at start.., keys at key_start..; True: attend."""
    key_positions = torch.arange(key_start, context_len, dtype=torch.int64, device=device)
    query_positions = torch.arange(start, context_len, dtype=torch.int64, device=device)
    return key_positions[None, :] <= query_positions[:, None]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    kv_scales: KVScales = UNIT,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, H_kv, D], kv_cache [2, num_blocks, H_kv, block_size, D] (kv_cache.layer_shape) ->
    [T, H, D]. scale: of q.k (None: D ** -0.5); window: this layer's sliding window (the one `meta` was built for);
    softcap: scores -> softcap * tanh(scores / softcap) before masking; kv_scales: the cache holds K / kv_scales.k
    and V / kv_scales.v (an fp8 cache's, model/kv_scales.py)."""
    if window is not None and window != meta.sliding_window:
        raise ValueError(f"a layer with sliding window {window} needs metadata built for it, got {meta.sliding_window}")
    rows = meta.cache_rows if meta.cache_rows is not None else cache_rows(meta.slot_mapping, kv_cache)
    if kv_scales.is_unit:
        _write_rows(kv_cache[0], rows, k)
        _write_rows(kv_cache[1], rows, v)
        return _attend_cache(q, kv_cache, meta, scale, window, softcap)
    # Every kernel reads the stored K and V: q.(s_k K) = s_k (q.K) and softmax(.)(s_v V) = s_v (softmax(.) V).
    _write_rows(kv_cache[0], rows, k / kv_scales.k)
    _write_rows(kv_cache[1], rows, v / kv_scales.v)
    key_scale = (q.shape[-1] ** -0.5 if scale is None else scale) * kv_scales.k
    return _attend_cache(q, kv_cache, meta, key_scale, window, softcap).mul_(kv_scales.v)


def _attend_cache(q, kv_cache, meta: AttentionMetadata, scale, window, softcap) -> torch.Tensor:
    """q against the layer's cached K/V, the step's own already written."""
    if meta.query_start_loc is not None:
        from flotilla.engine.model import triton_attention  # imports triton: only where it runs

        return triton_attention.paged_attention(q, kv_cache, meta.block_tables, meta.query_start_loc,
                                                meta.context_lens, meta.max_query_len, scale, window, softcap,
                                                max_context_len=meta.max_context_len)
    out = torch.empty_like(q)
    scores = _Scores(scale, window is not None, softcap)
    for group in meta.decode_groups:
        _decode_attention(q, kv_cache, group, out, scores)
    if meta.decode_rows is not None:
        _decode_with_kernel(q, kv_cache, meta.decode_rows, out, scale, window, softcap)
    if meta.prefill_batch is not None:
        prefill_kernel.paged_prefill_attention_batch(q, kv_cache, meta.prefill_batch, out, scale, window, softcap)
        return out
    for chunk in meta.prefills:
        out[chunk.token_slice] = _prefill_attention(q[chunk.token_slice], kv_cache, chunk, scores)
    return out


def _write_rows(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """New K (or V) [T, H_kv, D] into their rows of one of K or V ([num_blocks, H_kv, block_size, D]), cast to the
    cache's type; fp8 caches are written as bytes (index_copy_ has no fp8). A float32 cache on a CPU: a C loop
    that reads the new K/V in place (fused_ops.write_rows)."""
    if fused_ops.write_rows(cache, rows, values):
        return
    head_dim = cache.shape[-1]
    values = values.reshape(-1, head_dim).to(cache.dtype)
    if cache.element_size() == 1:
        cache.view(torch.uint8).view(-1, head_dim).index_copy_(0, rows, values.view(torch.uint8))
    else:
        cache.view(-1, head_dim).index_copy_(0, rows, values)


class _Scores(NamedTuple):
    """How a layer scores keys: q.k scale (None: SDPA's default), whether it uses the window masks, soft-cap."""

    scale: float | None
    windowed: bool
    softcap: float | None


def _gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """K and V of whole blocks in one copy: [2, num_seqs, H_kv, num_blocks_each * block_size, D] in `dtype` (the
    queries'). Copying whole blocks is several times faster than gathering token slots one by one."""
    _, num_kv_heads, block_size, head_dim = layer_dims(kv_cache)
    blocks = kv_cache.index_select(1, block_ids).view(2, num_seqs, -1, num_kv_heads, block_size, head_dim)
    return blocks.transpose(2, 3).reshape(2, num_seqs, num_kv_heads, -1, head_dim).to(dtype)


def _attend(q, keys, values, mask, scores: _Scores) -> torch.Tensor:
    """q [..., M, D] against keys/values [..., L, D] (batch dims broadcast), mask broadcastable to [..., M, L]
    (True: attend; None: causal, M == L). SDPA, or with a soft-cap the same steps written out as transformers'
    eager attention does them (float32 softmax)."""
    if scores.softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=scores.scale)
    logits = torch.matmul(q, keys.transpose(-1, -2)) * (scores.scale or q.shape[-1] ** -0.5)
    logits = torch.tanh(logits / scores.softcap) * scores.softcap
    if mask is None:
        mask = torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device).tril()
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype), values)


def _decode_attention(q, kv_cache, batch: DecodeBatch, out: torch.Tensor, scores: _Scores) -> None:
    """GQA without copying K/V: the G query heads sharing a KV head become G query rows of it."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = layer_dims(kv_cache).num_kv_heads
    rows = q[batch.token_slice] if batch.token_slice is not None else q[batch.token_indices]
    queries = rows.view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, H_kv, G, D]
    keys, values = _gather_blocks(kv_cache, batch.block_ids, queries.shape[0], q.dtype)  # [B, H_kv, L, D]
    result = _attend(queries, keys, values, batch.window_mask if scores.windowed else batch.mask, scores)
    result = result.reshape(-1, num_heads, head_dim)
    if batch.token_slice is not None:
        out[batch.token_slice] = result
    else:
        out.index_copy_(0, batch.token_indices, result)


def _decode_with_kernel(q, kv_cache, rows: DecodeRows, out: torch.Tensor, scale, window, softcap) -> None:
    if rows.token_slice is not None:  # decode rows side by side: the kernel writes the layer's output in place
        decode_kernel.paged_decode_attention(q[rows.token_slice], kv_cache, rows.block_tables, rows.context_lens,
                                             scale=scale, window=window, softcap=softcap, out=out[rows.token_slice])
        return
    result = decode_kernel.paged_decode_attention(
        q[rows.token_indices], kv_cache, rows.block_tables, rows.context_lens, scale=scale, window=window,
        softcap=softcap,
    )
    out.index_copy_(0, rows.token_indices, result)


def _prefill_attention(q, kv_cache, chunk: PrefillChunk, scores: _Scores) -> torch.Tensor:
    """4-D inputs and enable_gqa: 3-D inputs send SDPA to its slow math kernel on CPU (5x slower)."""
    block_ids, key_start, mask = chunk.block_ids, 0, chunk.mask
    if scores.windowed:
        block_ids, key_start, mask = chunk.window_block_ids, chunk.window_key_start, chunk.window_mask
    gathered = _gather_blocks(kv_cache, block_ids, 1, q.dtype)
    keys, values = gathered[:, :, :, : chunk.context_len - key_start]  # [1, H_kv, L, D]
    queries = q.transpose(0, 1)[None]  # [1, H, T, D]
    if scores.softcap is None:
        result = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=scores.scale
        )
        return result[0].transpose(0, 1)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = queries.view(num_kv_heads, num_heads // num_kv_heads, num_tokens, head_dim)  # [H_kv, G, T, D]
    result = _attend(grouped, keys.transpose(0, 1), values.transpose(0, 1), mask, scores)  # K/V [H_kv, 1, L, D]
    return result.reshape(num_heads, num_tokens, head_dim).transpose(0, 1)
