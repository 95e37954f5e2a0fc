"""Swap preemption's block copies between the device KV pool and its host copy, run by run.

A step's swaps go in one order, on every device:
  1. gather the swapped-out blocks of every layer into a device staging tensor (device memory: fast);
  2. copy the swapped-in blocks from the host pool into their device blocks;
  3. copy the staged blocks into their host blocks.
The step may write the blocks that step 1 freed (a swap-in target, a copy-on-write or new K/V), so it needs
steps 1 and 2 done, never step 3: on CUDA, steps 1-3 run on a side stream that first waits for the compute
stream (earlier steps wrote what is gathered), and the compute stream waits only for an event recorded after
step 2, so the device-to-host copies of a swap-out cross PCIe while the step computes. One side stream keeps
every swap in issue order: a host block is read (swap-in) only after the copy that filled it has landed and is
refilled (a later swap-out) only after the copy that read it. Host pools on CUDA are pinned
(`allocate_kv_cache(pin_memory=True)`), so the host copies are asynchronous.

Staging is bounded (STAGING_MAX_BYTES): a larger swap-out, or one the device has no room to stage, copies its blocks
straight to the host before the swap-ins, and the step then waits for those copies too. A step's swap-in sources
and swap-out destinations are disjoint host blocks (the scheduler's contract, `Scheduler._preempt_batch_for`;
checked here), so either order is safe.

Elsewhere (a CPU) the same steps run at once, in order. Consecutive block ids on both sides (a request's blocks
often are) move in one copy per layer and K/V half instead of one per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch

from flotilla.engine.device_copy import to_device
from flotilla.engine.scheduler_output import BlockCopy

# Device memory a swap-out may stage at once. Staged memory freed by the side stream stays cached for that stream,
# out of the compute stream's reach: a bound keeps that small beside a KV pool that takes most of the device.
STAGING_MAX_BYTES = 256 << 20


class BlockRun(NamedTuple):
    """Blocks src..src+length-1 -> dst..dst+length-1."""

    src: int
    dst: int
    length: int


def block_runs(pairs: Sequence[tuple[int, int]]) -> list[BlockRun]:
    """The pairs, in order, with each pair that continues the previous one on both sides merged into its run."""
    runs: list[BlockRun] = []
    for src, dst in pairs:
        if runs and src == runs[-1].src + runs[-1].length and dst == runs[-1].dst + runs[-1].length:
            runs[-1] = runs[-1]._replace(length=runs[-1].length + 1)
        else:
            runs.append(BlockRun(src, dst, 1))
    return runs


class KVSwapper:
    """Moves swap preemption's blocks between `device_caches` and `host_caches` (per-layer views
    [2, num_blocks, ...] of `allocate_kv_cache`)."""

    def __init__(self, device_caches: Sequence[torch.Tensor], host_caches: Sequence[torch.Tensor]) -> None:
        if len(device_caches) != len(host_caches):
            raise ValueError(f"{len(device_caches)} device layers but {len(host_caches)} host layers")
        self.device_caches, self.host_caches = list(device_caches), list(host_caches)
        device = self.device_caches[0].device if self.device_caches else torch.device("cpu")
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def apply(self, swap_out: Sequence[BlockCopy], swap_in: Sequence[BlockCopy]) -> None:
        """swap_out: (device block, host block) pairs; swap_in: (host block, device block) pairs. On return the
        device blocks are safe for the caller's stream to overwrite (swap_out) and read (swap_in)."""
        if not swap_out and not swap_in:
            return
        reused = {copy.src for copy in swap_in} & {copy.dst for copy in swap_out}
        if reused:
            raise ValueError(f"host blocks {sorted(reused)} are both swapped in from and out to in one step")
        side = self._side_stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side) if side is not None else nullcontext():
            staged = self._gather([copy.src for copy in swap_out])
            if staged is None:  # no staging: straight to the host, before the swap-ins overwrite freed blocks
                _copy_runs(self.host_caches, self.device_caches, block_runs(swap_out))
            _copy_runs(self.device_caches, self.host_caches, block_runs(swap_in))
            if side is not None:
                ready = torch.cuda.Event()
                ready.record(side)
            if staged is not None:
                _copy_runs(self.host_caches, staged, block_runs([(i, copy.dst) for i, copy in enumerate(swap_out)]))
        if side is not None:
            # The staging tensors were allocated on the side stream: the caching allocator reuses their memory
            # only for work queued after the copies that read them.
            torch.cuda.current_stream(side.device).wait_event(ready)

    def _gather(self, device_blocks: list[int]) -> list[torch.Tensor] | None:
        """The blocks of every layer in staging tensors; None where they would pass STAGING_MAX_BYTES or the device
        has no room for them."""
        if not device_blocks:
            return []
        layer = self.device_caches[0]
        if len(device_blocks) * len(self.device_caches) * layer[:, 0].numel() * layer.element_size() > STAGING_MAX_BYTES:
            return None
        index = to_device(device_blocks, layer.device, torch.int64)  # pinned: no wait for the side stream's copies
        try:
            return [cache.index_select(1, index) for cache in self.device_caches]
        except torch.OutOfMemoryError:
            return None


def _copy_runs(dst_caches: Sequence[torch.Tensor], src_caches: Sequence[torch.Tensor], runs: list[BlockRun]) -> None:
    """Every layer's K and V of each run, src_caches -> dst_caches. A run's blocks of one K/V half are one
    contiguous slice on both sides, so a copy between pinned host memory and a GPU is asynchronous."""
    if not runs:
        return
    for dst_layer, src_layer in zip(dst_caches, src_caches):
        for half in range(2):
            for run in runs:
                dst_layer[half, run.dst : run.dst + run.length].copy_(
                    src_layer[half, run.src : run.src + run.length], non_blocking=True
                )
