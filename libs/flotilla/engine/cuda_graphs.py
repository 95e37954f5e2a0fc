"""Decode steps replayed from CUDA graphs: one graph per captured batch size, a step padded to the next size.

A graph replays fixed kernels on fixed addresses, so a decode step's inputs live in static buffers that each step
overwrites: token ids, positions, cache slots, block tables (a fixed width: the model's context window) and context
lengths. Padding rows have context length 0 (the Triton kernel reads no key for them and writes zeros) and write
their K/V into one spare slot past the pool's blocks that no request owns. Prefill and mixed steps run eagerly.

Sizes are captured smallest first until the graphs' memory passes the budget; larger batches then run eagerly.
Off CUDA (tests) `DecodeGraphs` runs the same static-buffer step eagerly, so its inputs and metadata are checked
on a CPU; the capture itself is the device check's (loadtest/gpu_check.py).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from flotilla.engine.device_copy import pinned
from flotilla.engine.model.attention import AttentionMetadata
from flotilla.engine.model.moe import expert_layers

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (max_batch itself included): padding wastes at most 7 rows."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [size for size in (1, 2, 4) if size < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `batch` rows; None when none does (the step runs eagerly)."""
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else None


class DecodeRow(NamedTuple):
    """One sequence's decode token: its id, position (= context length - 1) and block table."""

    token_id: int
    position: int
    block_ids: Sequence[int]


def padded_inputs(rows: Sequence[DecodeRow], bucket: int, width: int, block_size: int, pad_slot: int) -> dict:
    """Host tensors for a step of len(rows) <= bucket decode rows, padded to `bucket`: input_ids, positions,
    slot_mapping, context_lens [bucket] and block_tables [bucket, w] (int64), w <= width the blocks the longest
    row needs (columns past it are never read, so a step copies only these)."""
    if not 0 < len(rows) <= bucket:
        raise ValueError(f"{len(rows)} rows do not fit a bucket of {bucket}")
    padding = bucket - len(rows)
    tables = torch.zeros(bucket, max(row.position // block_size + 1 for row in rows), dtype=torch.int64)
    slots = []
    for i, row in enumerate(rows):
        needed = row.position // block_size + 1
        if needed > width or len(row.block_ids) < needed:
            raise ValueError(f"row {i}: position {row.position} needs {needed} blocks (table width {width}, "
                             f"{len(row.block_ids)} given)")
        tables[i, :needed] = torch.tensor(row.block_ids[:needed], dtype=torch.int64)
        slots.append(row.block_ids[row.position // block_size] * block_size + row.position % block_size)
    return {
        "input_ids": torch.tensor([row.token_id for row in rows] + [0] * padding, dtype=torch.int64),
        "positions": torch.tensor([row.position for row in rows] + [0] * padding, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots + [pad_slot] * padding, dtype=torch.int64),
        "context_lens": torch.tensor([row.position + 1 for row in rows] + [0] * padding, dtype=torch.int64),
        "block_tables": tables,
    }


def graphs_apply(model) -> bool:
    """Graphs replay fixed work: MoE layers only where they run grouped (settle_experts_way chose it: fixed shapes,
    routing read on the device; the loop's shapes follow each step's routing, read back), no length-dependent RoPE
    (host-side choices per step)."""
    if model.config.moe is not None:
        experts = expert_layers(model)
        if not experts or not all(module.grouped is True for module in experts):
            return False
    return all(rope.long_after is None and rope.dynamic_after is None for rope in model.model.rotary_embeddings())


class GraphCaptureError(RuntimeError):
    """A decode graph could not be built at start-up; the message names the flag that turns graphs off."""


class _Static(NamedTuple):
    inputs: dict[str, torch.Tensor]  # device buffers, one per padded_inputs key
    meta: AttentionMetadata
    hidden: torch.Tensor  # [bucket, hidden] the forward's output, overwritten by every replay
    graph: torch.cuda.CUDAGraph | None


class DecodeGraphs:
    """Static buffers and (on CUDA) one captured graph per batch size. The model must use the Triton backend."""

    def __init__(self, model, kv_caches: Sequence[torch.Tensor], sizes: Sequence[int], width: int, block_size: int,
                 pad_slot: int, device: torch.device, memory_budget: int = 2 << 30):
        self.model, self.kv_caches = model, kv_caches
        self.width, self.block_size, self.pad_slot, self.device = width, block_size, pad_slot, device
        self.capture = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._static: dict[int, _Static] = {}
        used_before = torch.cuda.memory_reserved(device) if self.capture else 0
        for size in sorted(sizes):
            try:
                self._static[size] = self._build(size)
            except Exception as error:
                # Not retried eagerly: a capture that broke halfway can leave the stream and the graph pool in a
                # state no later step should trust. The worker stops with the way around it.
                raise GraphCaptureError(
                    f"capturing the decode CUDA graph for batch size {size} failed ({type(error).__name__}: {error}); "
                    "start the worker with --no-cuda-graphs (EngineConfig.cuda_graphs=False) to run decode steps "
                    "eagerly") from error
            used = torch.cuda.memory_reserved(device) - used_before if self.capture else 0
            if used > memory_budget:
                log.info("CUDA graphs: captured batch sizes up to %d (%d MiB, budget %d MiB)", size, used >> 20,
                         memory_budget >> 20)
                break
        self.sizes = sorted(self._static)

    def _build(self, size: int) -> _Static:
        inputs = {name: torch.zeros(size, dtype=torch.int64, device=self.device)
                  for name in ("input_ids", "positions", "context_lens")}  # context 0: nothing read while capturing
        inputs["slot_mapping"] = torch.full((size,), self.pad_slot, dtype=torch.int64, device=self.device)
        inputs["block_tables"] = torch.zeros(size, self.width, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            num_tokens=size, positions=inputs["positions"], slot_mapping=inputs["slot_mapping"],
            context_lens=inputs["context_lens"], block_tables=inputs["block_tables"], decode_groups=(), prefills=(),
            sliding_window=self.model.config.sliding_window,
            query_start_loc=torch.arange(size + 1, dtype=torch.int64, device=self.device), max_query_len=1,
            # Split-K decode: the split count is fixed at capture, for the longest context the tables hold; each
            # replay's sequences divide their actual keys among those splits.
            max_context_len=self.width * self.block_size,
        )  # fmt: skip
        if not self.capture:
            return _Static(inputs, meta, torch.empty(0), None)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernel and settles allocator state
            self._forward(inputs, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(inputs, meta)
        return _Static(inputs, meta, hidden, graph)

    def _forward(self, inputs: dict[str, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(inputs["input_ids"], inputs["positions"], meta, self.kv_caches)

    def bucket_for(self, batch: int) -> int | None:
        return bucket_for(batch, self.sizes)

    def run(self, rows: Sequence[DecodeRow], placeholders=None) -> torch.Tensor:
        """Hidden states [len(rows), hidden] of one decode step, replayed from the graph of the next size up.
        placeholders (model_runner.Placeholders): token ids written on the device over the rows' host ones."""
        bucket = self.bucket_for(len(rows))
        if bucket is None:
            raise ValueError(f"no captured size holds {len(rows)} rows (largest {self.sizes[-1]})")
        static = self._static[bucket]
        host = padded_inputs(rows, bucket, self.width, self.block_size, self.pad_slot)
        for name, tensor in host.items():
            target = static.inputs[name]
            (target[:, : tensor.shape[1]] if tensor.dim() == 2 else target).copy_(pinned(tensor, target.device),
                                                                                  non_blocking=True)
        if placeholders is not None:
            static.inputs["input_ids"][placeholders.at] = placeholders.ids
        if static.graph is None:
            return self._forward(static.inputs, static.meta)[: len(rows)]
        static.graph.replay()
        return static.hidden[: len(rows)]
