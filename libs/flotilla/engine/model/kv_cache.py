"""The paged KV pool: one contiguous tensor, one view per layer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from flotilla.engine.device_copy import to_device
from flotilla.engine.model.config import ModelConfig

log = logging.getLogger(__name__)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    pin_memory: bool = False,
) -> list[torch.Tensor]:
    """Per-layer views [2, num_blocks, num_kv_heads, block_size, head_dim] (`layer_shape`) of ONE zeroed pool
    tensor [num_layers, 2, ...], so that the whole pool can be registered for transfer once
    (`kv_pool_tensor(kv_caches)` gives it back). `pin_memory` (host pools only, needs CUDA) makes
    copies between a host swap pool and the GPU asynchronous (`_pinned_layers`)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
    shape = (config.num_layers, *layer_shape(num_blocks, block_size, config.num_kv_heads, config.head_dim))
    if pin_memory:
        if device.type != "cpu":
            raise ValueError(f"only a host pool can be pinned, not one on {device}")
        return _pinned_layers(shape, dtype)
    return list(torch.zeros(shape, dtype=dtype, device=device).unbind(0))


def _pinned_layers(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """The per-layer views of a zeroed host pool in page-locked memory of exactly its size. torch's pinned
    allocator rounds every block up to the next power of two (torch 2.13, CachingHostAllocator: a 40 GiB swap pool
    would lock 64 GiB of the host's memory), so the pool is ordinary memory locked with cudaHostRegister. The
    registration is held by every view and undone when the last one goes. Where registering fails, torch's pinned
    allocator is used instead, and a warning says so."""
    pool = torch.zeros(shape, dtype=dtype)
    try:
        registration = _HostRegistration(pool)
    except (RuntimeError, AttributeError, AssertionError) as error:  # no CUDA here, or the driver refused
        log.warning("host KV pool: cudaHostRegister failed (%s); using torch's pinned allocator, which rounds the "
                    "pool's %d bytes up to a power of two", error, pool.numel() * pool.element_size())
        return list(torch.zeros(shape, dtype=dtype, pin_memory=True).unbind(0))
    layers = list(pool.unbind(0))
    for layer in layers:
        layer.host_registration = registration  # the pool stays locked while any view is alive
    return layers


class _HostRegistration:
    """cudaHostRegister of a tensor's memory for as long as this object lives (it keeps the tensor alive too)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister returned {status}")
        self.tensor, self._unregister = tensor, cudart.cudaHostUnregister

    def __del__(self) -> None:
        try:
            self._unregister(self.tensor.data_ptr())
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already; nothing to undo then
            pass


def layer_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's cache: [2 (K, V), num_blocks, num_kv_heads, block_size, head_dim], head-major inside a block.
    A KV head's keys of a block are one contiguous run (block_size * head_dim values), read in order by the CPU
    decode kernel: with 128-token blocks that ran 1.4x the token-major layout [.., block_size, num_kv_heads, ..]
    (loadtest/bench_kv_layout.py, docs/performance.md). A whole block is still one contiguous slice of K (or V),
    which is all that swap, copy-on-write and NIXL transfers address."""
    return (2, num_blocks, num_kv_heads, block_size, head_dim)


class LayerDims(NamedTuple):
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int


def layer_dims(kv_cache: torch.Tensor) -> LayerDims:
    """The sizes of one layer's cache made by `allocate_kv_cache` (or shaped by `layer_shape`)."""
    _, num_blocks, num_kv_heads, block_size, head_dim = kv_cache.shape
    return LayerDims(num_blocks, num_kv_heads, block_size, head_dim)


def token_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """A view of one layer's cache as [2, num_blocks, block_size, num_kv_heads, head_dim]: token t of block b is
    view[:, b, t]. For readers that think in tokens (tests' references, debugging); no copy."""
    return kv_cache.transpose(2, 3)


def cache_rows(slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """[T * num_kv_heads]: the rows of K (or V) viewed as [-1, head_dim] that token i's KV head h goes to (row
    i * num_kv_heads + h, the order of new K/V [T, num_kv_heads, head_dim] flattened), for writing a step's K/V with
    one index_copy_ (indexing the 4-D cache at (block, :, offset) was 5x slower for a decode step)."""
    _, num_kv_heads, block_size, _ = layer_dims(kv_cache)
    heads = torch.arange(num_kv_heads, dtype=slot_mapping.dtype, device=slot_mapping.device) * block_size
    block_starts = slot_mapping // block_size * (num_kv_heads * block_size) + slot_mapping % block_size
    return (block_starts[:, None] + heads[None, :]).reshape(-1)


def kv_pool_tensor(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The single tensor behind the per-layer views made by `allocate_kv_cache`."""
    first = kv_caches[0]
    layer_bytes = first.numel() * first.element_size()
    for i, layer in enumerate(kv_caches):
        if not layer.is_contiguous() or layer.data_ptr() != first.data_ptr() + i * layer_bytes:
            raise ValueError("kv_caches are not consecutive views of one pool tensor")
    return first.as_strided((len(kv_caches), *first.shape), (first.numel(), *first.stride()))


def copy_blocks(kv_caches: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write: K and V of block src -> block dst, in every layer. Sources are read before
    any destination is written, so the pairs behave as one simultaneous copy."""
    if not pairs:
        return
    device = kv_caches[0].device
    src = to_device([pair[0] for pair in pairs], device, torch.int64)
    dst = to_device([pair[1] for pair in pairs], device, torch.int64)
    for layer in kv_caches:
        layer[:, dst] = layer[:, src]


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes` (0 when not even one does)."""
    bytes_per_block = block_size * config.kv_bytes_per_token(dtype)
    return max(0, budget_bytes // bytes_per_block)
