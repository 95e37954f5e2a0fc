"""Where a worker's KV pool lives, described so that a peer can address single blocks in it.

The pool is one contiguous tensor [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size, head_dim]
(`flotilla.engine.model.kv_cache.kv_pool_tensor`). One (layer, K|V, block) slice is `block_bytes`
contiguous bytes, so descriptor i = (layer * 2 + kv) * num_blocks + block addresses it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KVPoolLayout:
    num_layers: int
    num_blocks: int
    block_bytes: int  # one block of K (or V) of one layer
    base_address: int
    device_id: int  # 0 for host memory
    mem_type: str  # "DRAM" (host) or "VRAM" (GPU)

    @classmethod
    def of_pool(cls, pool: torch.Tensor) -> KVPoolLayout:
        if pool.dim() != 6 or pool.shape[1] != 2 or not pool.is_contiguous():
            raise ValueError(f"expected a contiguous [L, 2, N, H, B, D] pool tensor, got {tuple(pool.shape)}")
        num_layers, _, num_blocks = pool.shape[:3]
        block_bytes = pool[0, 0, 0].numel() * pool.element_size()
        is_gpu = pool.device.type == "cuda"
        return cls(num_layers, num_blocks, block_bytes, pool.data_ptr(), pool.get_device() if is_gpu else 0,
                   "VRAM" if is_gpu else "DRAM")  # fmt: skip

    @property
    def num_descriptors(self) -> int:
        return self.num_layers * 2 * self.num_blocks

    @property
    def total_bytes(self) -> int:
        return self.num_descriptors * self.block_bytes

    def descriptors(self) -> np.ndarray:
        """Every (layer, K|V, block) slice as an Nx3 (address, length, device) array, in index order."""
        index = np.arange(self.num_descriptors, dtype=np.uint64)
        return np.stack(
            [
                np.uint64(self.base_address) + index * np.uint64(self.block_bytes),
                np.full_like(index, self.block_bytes),
                np.full_like(index, self.device_id),
            ],
            axis=1,
        )

    def layer_indices(self, layer: int, block_ids: Sequence[int]) -> np.ndarray:
        """Descriptor indices of K then V of `block_ids` in one layer."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        blocks = np.asarray(block_ids, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise ValueError(f"block ids must lie in 0..{self.num_blocks - 1}")
        k_base = layer * 2 * self.num_blocks
        return np.concatenate([k_base + blocks, k_base + self.num_blocks + blocks]).astype(np.int32)

    def compatible_with(self, other: KVPoolLayout) -> bool:
        """Blocks can move between the two pools (same model shape, block size and dtype)."""
        return self.num_layers == other.num_layers and self.block_bytes == other.block_bytes


@dataclass(frozen=True)
class PeerInfo:
    """What a writer needs to reach a receiver: its agent name, transport metadata and pool layout."""

    agent_name: str
    metadata: bytes
    layout: KVPoolLayout
