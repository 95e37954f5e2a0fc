"""Paged attention: per-step metadata built once, per-layer work is tensor ops only.

Each layer (1) writes every new token's K/V into the cache through `slot_mapping`, then
(2) reads each sequence's whole context back through its block table. Writing first matters:
a sequence may read blocks that another sequence of the same step has just written.
Decode chunks (one token) run batched in SDPA calls over a padded gather with a boolean mask, in groups
of consecutive sequences whose gathered K/V stays small (on a CPU a group that fits the caches runs
4x faster than one big batch; on a GPU one group); prefill chunks run one SDPA call each, causal with
an offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from flotilla.engine.model import decode_kernel


class SeqChunk(NamedTuple):
    """Tokens [start, start + num_tokens) of one sequence are computed this step; block_ids is its block table."""

    start: int
    num_tokens: int
    block_ids: list[int]


@dataclass(frozen=True)
class DecodeBatch:
    """All one-token chunks of a step, attended in one padded SDPA call."""

    token_indices: torch.Tensor  # [B] rows of the flattened input
    token_slice: slice | None  # the same rows as a slice when they are a contiguous run (the usual case)
    block_ids: torch.Tensor  # [B * W] every sequence's block table padded to W blocks (padding: block 0)
    mask: torch.Tensor  # [B, 1, 1, W * block_size] True where the key is inside the sequence's context


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
    seq_ends: torch.Tensor | None = None  # [T] context length after the step of each token's sequence

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqChunk],
        block_size: int,
        device: torch.device,
        max_decode_group_tokens: int | None = None,
        use_decode_kernel: bool = False,
    ) -> AttentionMetadata:
        """max_decode_group_tokens caps the padded context tokens gathered per decode SDPA call; None picks
        a per-device default. Order decode chunks by context length to keep padding small.
        use_decode_kernel: decode through the CPU kernel (decode_kernel.applies) instead of SDPA groups."""
        _validate(seqs, block_size)
        starts = [seq.start for seq in seqs]
        counts = [seq.num_tokens for seq in seqs]
        ends = [start + count for start, count in zip(starts, counts)]
        offsets = _exclusive_cumsum(counts)
        block_tables = _block_table_tensor(seqs, ends, block_size, device)
        positions = _positions(starts, counts, offsets, device)
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(seqs), device=device), torch.tensor(counts, device=device)
        )
        slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        context_lens = torch.tensor(ends, dtype=torch.int64, device=device)
        decode_ids = [i for i, count in enumerate(counts) if count == 1]
        decode_rows = None
        decode_groups: tuple[DecodeBatch, ...] = ()
        if use_decode_kernel and decode_ids:
            decode_rows = _decode_rows(decode_ids, offsets, ends, block_tables, device)
        else:
            group_tokens = max_decode_group_tokens or _default_decode_group_tokens(device)
            decode_groups = tuple(
                _decode_batch(group, offsets, ends, block_tables, block_size, device)
                for group in _decode_groups(decode_ids, ends, group_tokens)
            )
        prefills = tuple(
            _prefill_chunk(starts[i], counts[i], offsets[i], block_tables[i], block_size, device)
            for i in range(len(seqs))
            if counts[i] > 1
        )
        return cls(
            num_tokens=sum(counts),
            positions=positions,
            slot_mapping=slot_mapping,
            context_lens=context_lens,
            block_tables=block_tables,
            decode_groups=decode_groups,
            decode_rows=decode_rows,
            prefills=prefills,
            seq_ends=context_lens[seq_of_token],
        )


def _validate(seqs: Sequence[SeqChunk], block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
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


def _block_table_tensor(seqs: Sequence[SeqChunk], ends: list[int], block_size: int, device) -> torch.Tensor:
    """Only the blocks each context needs; a longer table (blocks reserved ahead) is cut."""
    needed = [-(-end // block_size) for end in ends]
    width = max(needed)
    rows = [list(seq.block_ids[:n]) + [0] * (width - n) for seq, n in zip(seqs, needed)]
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def _positions(starts: list[int], counts: list[int], offsets: list[int], device) -> torch.Tensor:
    """start_i + (token index - offset_i) for every token, without a Python loop over tokens."""
    per_token_shift = torch.repeat_interleave(
        torch.tensor([start - offset for start, offset in zip(starts, offsets)], dtype=torch.int64),
        torch.tensor(counts),
    )
    return (torch.arange(sum(counts), dtype=torch.int64) + per_token_shift).to(device, non_blocking=True)


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


def _decode_rows(decode_ids: list[int], offsets, ends, block_tables, device) -> DecodeRows:
    rows = [offsets[i] for i in decode_ids]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
    return DecodeRows(
        token_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        token_slice=slice(rows[0], rows[0] + len(rows)) if contiguous else None,
        block_tables=block_tables[ids].contiguous(),
        context_lens=torch.tensor([ends[i] for i in decode_ids], dtype=torch.int64, device=device),
    )


def _decode_batch(decode_ids: list[int], offsets, ends, block_tables, block_size, device) -> DecodeBatch:
    rows = [offsets[i] for i in decode_ids]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    width = -(-max(ends[i] for i in decode_ids) // block_size)
    ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
    context_lens = torch.tensor([ends[i] for i in decode_ids], dtype=torch.int64, device=device)
    key_positions = torch.arange(width * block_size, dtype=torch.int64, device=device)
    mask = key_positions[None, :] < context_lens[:, None]
    return DecodeBatch(
        token_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        token_slice=slice(rows[0], rows[0] + len(rows)) if contiguous else None,
        block_ids=block_tables[ids, :width].reshape(-1),
        mask=mask[:, None, None, :],
    )


def _prefill_chunk(start, count, offset, block_row, block_size, device) -> PrefillChunk:
    context_len = start + count
    mask = None
    if start > 0:
        key_positions = torch.arange(context_len, dtype=torch.int64, device=device)
        query_positions = torch.arange(start, context_len, dtype=torch.int64, device=device)
        mask = key_positions[None, :] <= query_positions[:, None]
    return PrefillChunk(
        token_slice=slice(offset, offset + count),
        block_ids=block_row[: -(-context_len // block_size)],
        context_len=context_len,
        mask=mask,
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q [T, H, D], k/v [T, H_kv, D], kv_cache [2, num_blocks, block_size, H_kv, D] -> [T, H, D]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    k_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        _decode_attention(q, kv_cache, group, out)
    if meta.decode_rows is not None:
        _decode_with_kernel(q, kv_cache, meta.decode_rows, out)
    for chunk in meta.prefills:
        out[chunk.token_slice] = _prefill_attention(q[chunk.token_slice], kv_cache, chunk)
    return out


def _gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """K and V of whole blocks in one copy: [2, num_seqs, num_blocks_each * block_size, H_kv, D].
    Copying whole blocks is several times faster than gathering token slots one by one."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return kv_cache.index_select(1, block_ids).view(2, num_seqs, -1, num_kv_heads, head_dim)


def _decode_attention(q, kv_cache, batch: DecodeBatch, out: torch.Tensor) -> None:
    """GQA without copying K/V: the G query heads sharing a KV head become G query rows of it."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[-2]
    rows = q[batch.token_slice] if batch.token_slice is not None else q[batch.token_indices]
    queries = rows.view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, H_kv, G, D]
    keys, values = _gather_blocks(kv_cache, batch.block_ids, queries.shape[0]).transpose(2, 3)  # [B, H_kv, L, D]
    result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask)
    result = result.reshape(-1, num_heads, head_dim)
    if batch.token_slice is not None:
        out[batch.token_slice] = result
    else:
        out.index_copy_(0, batch.token_indices, result)


def _decode_with_kernel(q, kv_cache, rows: DecodeRows, out: torch.Tensor) -> None:
    queries = q[rows.token_slice] if rows.token_slice is not None else q[rows.token_indices]
    result = decode_kernel.paged_decode_attention(queries, kv_cache, rows.block_tables, rows.context_lens)
    if rows.token_slice is not None:
        out[rows.token_slice] = result
    else:
        out.index_copy_(0, rows.token_indices, result)


def _prefill_attention(q, kv_cache, chunk: PrefillChunk) -> torch.Tensor:
    """4-D inputs and enable_gqa: 3-D inputs send SDPA to its slow math kernel on CPU (5x slower)."""
    keys, values = _gather_blocks(kv_cache, chunk.block_ids, 1)[:, :, : chunk.context_len].transpose(2, 3)
    result = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None, enable_gqa=True
    )
    return result[0].transpose(0, 1)
