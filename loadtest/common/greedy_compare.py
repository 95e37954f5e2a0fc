"""Greedy runs of the engine with their log-probabilities, and how two such runs compare: the device check's
exactness part (gpu_exactness.py) and the KV-format accuracy benchmark (bench_kv_dtype.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams

Run = tuple[list[list[int]], list[list[float]]]  # per prompt: the token ids, their log-probabilities


def greedy_with_logprobs(engine: LLMEngine, prompts: Sequence[Sequence[int]], new_tokens: int,
                         ignore_eos: bool = False) -> Run:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0, ignore_eos=ignore_eos)
    ids = [f"check-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(NewRequest(request_id, tuple(prompt), params))
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            logprobs[output.request_id] += [entry.logprob for entry in output.logprobs]
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


@torch.inference_mode()
def transformers_greedy(model, prompts: Sequence[Sequence[int]], new_tokens: int, eos: list[int]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    results = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0])
        results.append(out[0, len(prompt):].tolist())
    return results


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of b's tokens that a matches before their first difference (1.0: the same greedy text)."""
    matched = total = 0
    for x, y in zip(a, b):
        total += len(y)
        for p, q in zip(x, y):
            if p != q:
                break
            matched += 1
    return matched / max(total, 1)


def logprob_errors(a: Run, b: Run) -> list[float]:
    """|logprob difference| at every position where both runs still chose the same tokens."""
    errors = []
    for x, xl, y, yl in zip(*a, *b):
        for p, pl, q, ql in zip(x, xl, y, yl):
            if p != q:
                break
            errors.append(abs(pl - ql))
    return errors
