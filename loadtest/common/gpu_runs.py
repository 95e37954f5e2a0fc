"""What the device check's parts share (loadtest/gpu_check.py): the plan of a run, prompts, engines and transformers
models on the device, and freeing them between runs."""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import NamedTuple

import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from loadtest.common.random_llama import TOKENIZER_VOCAB


class Plan(NamedTuple):
    exact_size: str
    perf_size: str
    exact_prompts: int
    exact_prompt_len: int
    exact_new_tokens: int
    decode_prompt_len: int
    decode_new_tokens: int
    batch: int
    batch_prompt_len: int
    batch_new_tokens: int
    prefill_requests: int
    prefill_len: int
    bandwidth_mib: int
    matmul_size: int
    kv_bytes: int
    max_model_len: int


# exact and perf sizes, exactness prompts / length / new tokens, batch-1 prompt / new tokens, batch, its prompt /
# new tokens, prefill requests / length, bandwidth buffer MiB, matmul size, KV bytes, max_model_len
FULL = Plan("1b", "8b", 8, 64, 32, 128, 128, 64, 128, 128, 32, 1024, 4096, 8192, 16 << 30, 2048)
DRY = Plan("tiny", "tiny", 2, 16, 6, 8, 8, 4, 8, 8, 4, 32, 64, 256, 64 << 20, 256)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, TOKENIZER_VOCAB) for _ in range(length)] for _ in range(count)]


def start_engine(model_dir: Path, device: torch.device, plan: Plan, **overrides) -> LLMEngine:
    settings = dict(model_dir=str(model_dir), device=device.type, kv_cache_memory_bytes=plan.kv_bytes,
                    max_model_len=plan.max_model_len, max_num_seqs=max(plan.batch, plan.prefill_requests),
                    max_num_batched_tokens=max(2048, plan.prefill_len * 8))
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def hf_model(model_dir: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
