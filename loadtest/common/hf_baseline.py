"""Hugging Face transformers as the baseline: one request at a time, and static left-padded batches."""

from __future__ import annotations

import time
from typing import Any

import torch

from loadtest.common.engine_workload import Workload
from loadtest.common.throughput import Throughput


def load_hf_model(model_dir: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM  # heavy import: only when this baseline runs
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar on stderr would interleave with the report
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def _generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_new: int, pad_id: int):
    # min_new_tokens == max_new_tokens forces the length: EOS is masked until the last token.
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        pad_token_id=pad_id,
    )


def run_one_at_a_time(model: Any, workload: Workload, pad_id: int, note: str = "") -> Throughput:
    device = model.device
    started = time.perf_counter()
    for prompt, num_new in zip(workload.prompts, workload.max_tokens):
        input_ids = torch.tensor([prompt], device=device)
        out = _generate(model, input_ids, torch.ones_like(input_ids), num_new, pad_id)
        _check_length(out.shape[1] - len(prompt), num_new)
    seconds = time.perf_counter() - started
    return Throughput("transformers-1", workload.num_output_tokens, seconds, workload.num_requests, note)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded on the left, so every row's last real token sits in the last column and generation
    continues from there; the mask hides the padding (generate derives position ids from it)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def run_static_batches(model: Any, workload: Workload, batch_size: int, pad_id: int) -> Throughput:
    """Batches in request order; each runs until its longest request is done (the static-batching cost),
    but only the tokens each request asked for count as output."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    started = time.perf_counter()
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[first : first + batch_size]
        num_new = max(workload.max_tokens[first : first + batch_size])
        input_ids, attention_mask = left_padded(prompts, pad_id, model.device)
        out = _generate(model, input_ids, attention_mask, num_new, pad_id)
        _check_length(out.shape[1] - input_ids.shape[1], num_new)
    seconds = time.perf_counter() - started
    return Throughput(f"transformers-{batch_size}", workload.num_output_tokens, seconds, workload.num_requests)


def warm_up(model: Any, prompt: list[int], pad_id: int) -> None:
    """One short generate, so one-time set-up (kernels, allocator) is not billed to the first request."""
    input_ids = torch.tensor([prompt[:8]], device=model.device)
    _generate(model, input_ids, torch.ones_like(input_ids), 2, pad_id)


def _check_length(produced: int, wanted: int) -> None:
    # A benchmark that silently produced fewer tokens would report a rate for work it did not do.
    if produced != wanted:
        raise RuntimeError(f"transformers produced {produced} tokens where {wanted} were forced")
