"""Engine settings and their resolution at start-up (device, dtype, KV pool size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~260k tokens of the tiny model
GPU_KV_MEMORY_FRACTION = 0.85  # of the memory left free once the weights are loaded


@dataclass
class EngineConfig:
    model_dir: str
    device: str = "auto"  # "auto": cuda when present, else cpu
    dtype: str = "auto"  # "auto": float32 on cpu (no bf16 units here), the checkpoint's 16-bit type on cuda
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # budget for the KV pool; None = a per-device default
    num_kv_blocks: int | None = None  # overrides the byte budget (tests)
    num_host_kv_blocks: int = 0  # host blocks for swap preemption
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_num_seqs: int = 256
    num_lookahead_steps: int = 4  # growth reserved at admission: projected KV = known tokens + this many
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    max_model_len: int | None = None  # cap below the checkpoint's context window
    seed: int = 0  # for requests without a seed of their own

    def validate(self) -> None:
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.num_host_kv_blocks < 1:
            raise ValueError("preemption_mode 'swap' needs num_host_kv_blocks >= 1")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if name != "auto":
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
        return dtype
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == torch.float16 else torch.bfloat16


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes * GPU_KV_MEMORY_FRACTION)
    return DEFAULT_CPU_KV_BYTES
