"""Engine settings and their resolution at start-up (device, dtype, KV pool size)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from flotilla.engine.model.cpu_linear import BACKENDS as CPU_LINEAR_BACKENDS

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~260k tokens of the tiny model
GPU_KV_MEMORY_FRACTION = 0.85  # of the memory left free once the weights are loaded
# The batch bound's default target TPOT (--target-tpot-ms auto). On a CPU, the tiny test model's step takes
# ~9 ms with 1 sequence, ~28 ms with 32 and ~48 ms with 64 (one core, docs/performance.md): 40 ms keeps
# ~48 sequences per step on an idle core and fewer when the machine is busy.
DEFAULT_TARGET_TPOT_S = {"cuda": 0.050, "cpu": 0.040}
# Tokens per KV block (block_size None). A CPU's decode kernel reads each KV head's run of a block in order and runs
# 1.4x faster on 128-token runs than on 16 (docs/performance.md, loadtest/bench_kv_layout.py); vLLM's CPU build
# uses 128 too. On a GPU, 16 keeps prefix-cache hits and the last block's waste fine-grained.
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}


@dataclass
class EngineConfig:
    model_dir: str
    device: str = "auto"  # "auto": cuda when present, else cpu
    dtype: str = "auto"  # "auto": float32 on cpu (no bf16 units here), the checkpoint's 16-bit type on cuda
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; or float8_e4m3fn / float8_e5m2 (half the KV bytes)
    # An fp8 cache's per-layer K/V scales: "auto" (the checkpoint's k_scale/v_scale tensors when it has them, else
    # calibrated), "checkpoint" (its tensors, or start-up fails), "calibrate" (measured by a pass over a fixed text
    # at start-up, model/kv_scales.py) or "unit" (1.0: values past the format's range saturate). Other caches
    # ignore it.
    kv_cache_scales: str = "auto"
    attention_backend: str = "auto"  # "auto": triton on cuda, torch (SDPA + the C decode kernel) on cpu
    # "auto": float32 linears on a cpu through the engine's own matmul with packed weights ("panel",
    # model/panel_gemm.py), else oneDNN's ("onednn"), F.linear elsewhere ("torch"; model/cpu_linear.py)
    cpu_linear_backend: str = "auto"
    # Shapes each of oneDNN's primitive caches keeps (cpu_linear.bound_primitive_caches); None: oneDNN's 1,024
    onednn_primitive_cache_capacity: int | None = 16
    # On a cpu: glibc keeps the memory freed between steps for the next one rather than unmapping it (host_malloc.py)
    keep_freed_host_memory: bool = True
    cuda_graphs: bool = True  # capture decode steps on cuda (cuda_graphs.py); ignored on cpu
    # Each step is scheduled and launched while the one before runs (its decodes read that step's tokens on the
    # device), and a step's text is made while the next runs (engine.py, step); None: on for cuda except for MoE
    # models, off on a cpu (where the host and the forward pass share the cores and nothing overlaps)
    overlap_output_processing: bool | None = None
    cuda_graph_max_batch: int | None = None  # largest captured decode batch; None: max_num_seqs
    cuda_graph_memory_bytes: int = 2 << 30  # captures stop before their pool would pass this
    block_size: int | None = None  # tokens per KV block; None: DEFAULT_BLOCK_SIZE for the device
    kv_cache_memory_bytes: int | None = None  # budget for the KV pool; None = a per-device default
    num_kv_blocks: int | None = None  # overrides the byte budget (tests)
    num_host_kv_blocks: int = 0  # host blocks for swap preemption
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_num_seqs: int = 256
    # Sequences per step bounded so that steps (each one token of every sequence in it: the TPOT) stay under
    # this (batch_bound.py); None = off. `flotilla worker --target-tpot-ms` sets it (auto: 50 ms on cuda).
    target_tpot_s: float | None = None
    # Batch-class sequences sit out the steps in which an interactive request waits for or is in its prefill (at
    # most hold_batch_max_steps in a row), and are the first preempted for an interactive one (scheduler.py).
    hold_batch: bool = True
    hold_batch_max_steps: int = 8
    num_lookahead_steps: int = 4  # growth reserved at admission: projected KV = known tokens + this many
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    max_model_len: int | None = None  # cap below the checkpoint's context window
    seed: int = 0  # for requests without a seed of their own

    def validate(self) -> None:
        if (self.block_size is not None and self.block_size < 1) or self.max_num_batched_tokens < 1 \
                or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.cpu_linear_backend not in CPU_LINEAR_BACKENDS:
            raise ValueError(f"cpu_linear_backend must be one of {CPU_LINEAR_BACKENDS}, got {self.cpu_linear_backend!r}")
        if self.onednn_primitive_cache_capacity is not None and self.onednn_primitive_cache_capacity < 1:
            raise ValueError(f"onednn_primitive_cache_capacity must be >= 1 (None: oneDNN's default), got "
                             f"{self.onednn_primitive_cache_capacity}")
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scales must be one of {KV_CACHE_SCALES}, got {self.kv_cache_scales!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.target_tpot_s is not None and self.target_tpot_s <= 0:
            raise ValueError(f"target_tpot_s must be > 0 (None: off), got {self.target_tpot_s}")
        if self.hold_batch_max_steps < 1:
            raise ValueError(f"hold_batch_max_steps must be >= 1, got {self.hold_batch_max_steps}")
        if self.preemption_mode == "swap" and self.num_host_kv_blocks < 1:
            raise ValueError("preemption_mode 'swap' needs num_host_kv_blocks >= 1")


ATTENTION_BACKENDS = ("auto", "triton", "torch")
KV_CACHE_SCALES = ("auto", "checkpoint", "calibrate", "unit")
KV_CACHE_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def resolve_target_tpot_s(value_ms: str, device_name: str) -> float | None:
    """`--target-tpot-ms`: "auto" (DEFAULT_TARGET_TPOT_S for the device), "off" or 0 (no bound), or milliseconds."""
    if value_ms == "auto":
        return DEFAULT_TARGET_TPOT_S.get(resolve_device(device_name).type)
    if value_ms == "off":
        return None
    try:
        milliseconds = float(value_ms)
    except ValueError:
        raise ValueError(f"--target-tpot-ms must be auto, off or milliseconds, got {value_ms!r}") from None
    if milliseconds < 0 or milliseconds != milliseconds:
        raise ValueError(f"--target-tpot-ms must be >= 0, got {value_ms!r}")
    return milliseconds / 1000 or None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_block_size(block_size: int | None, device: torch.device) -> int:
    return block_size or DEFAULT_BLOCK_SIZE.get(device.type, DEFAULT_BLOCK_SIZE["cuda"])


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


FP8_MIN_CAPABILITY = (8, 9)  # fp8 conversions on the GPU: Ada, Hopper and later


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's element type. fp8 halves the pool's bytes (twice the blocks per budget); the Triton kernel
    widens it on load, the torch path widens whole gathered blocks (slower: for tests and CPUs). On CUDA, fp8 needs
    a GPU with fp8 conversions (compute capability 8.9: Ada, Hopper and later)."""
    if name == "auto":
        return model_dtype
    dtype = KV_CACHE_DTYPES[name]
    if dtype.itemsize == 1 and device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        major, minor = FP8_MIN_CAPABILITY
        raise ValueError(f"kv_cache_dtype {name} needs a GPU of compute capability {major}.{minor} or later")
    return dtype


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """"triton" or "torch", chosen once at start-up. auto: triton on cuda (when importable), torch elsewhere. An
    explicit triton off cuda needs Triton's interpreter (TRITON_INTERPRET=1: tests only, very slow)."""
    if name == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend 'triton' needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend 'triton' runs on cuda (on {device.type} only with TRITON_INTERPRET=1)")
    return name
