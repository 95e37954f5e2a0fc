"""The paged KV pool: one contiguous tensor, one view per layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flotilla.engine.model.config import ModelConfig


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    pin_memory: bool = False,
) -> list[torch.Tensor]:
    """Per-layer views [2, num_blocks, block_size, num_kv_heads, head_dim] of ONE zeroed pool tensor
    [num_layers, 2, ...], so that the whole pool can be registered for transfer once
    (`kv_pool_tensor(kv_caches)` gives it back). `pin_memory` (host pools only, needs CUDA) makes
    copies between a host swap pool and the GPU asynchronous."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    pool = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    return list(pool.unbind(0))


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
    src = torch.tensor([pair[0] for pair in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([pair[1] for pair in pairs], dtype=torch.int64, device=device)
    for layer in kv_caches:
        layer[:, dst] = layer[:, src]


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in `budget_bytes` (0 when not even one does)."""
    bytes_per_block = block_size * config.kv_bytes_per_token(dtype)
    return max(0, budget_bytes // bytes_per_block)
