"""Token sampling for one step: greedy rows by argmax, the rest by temperature, top-k and top-p.

Randomness is stateless per token: the noise for a request's i-th output token comes from a generator
seeded with (seed, i). The same seed gives the same samples whatever else shares the batch, and a
stream resumed elsewhere at token i continues the same sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from flotilla.engine.request import Request
from flotilla.engine.scheduler_output import TokenLogprobs


def sample(logits: torch.Tensor, requests: Sequence[Request], default_seed: int) -> list[int]:
    """logits [N, V] float32, one row per request -> one token id per row."""
    greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
    token_ids = [0] * len(requests)
    if greedy:
        picked = logits[greedy].argmax(dim=-1).tolist()
        for row, token_id in zip(greedy, picked):
            token_ids[row] = token_id
    for row, request in enumerate(requests):
        if not request.sampling_params.is_greedy:
            token_ids[row] = _sample_row(logits[row], request, default_seed)
    return token_ids


def _sample_row(logits: torch.Tensor, request: Request, default_seed: int) -> int:
    params = request.sampling_params
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    generator = torch.Generator(device=logits.device)
    seed = params.seed if params.seed is not None else _request_seed(default_seed, request.request_id)
    generator.manual_seed(_token_seed(seed, request.num_previous_output_tokens + request.num_output_tokens))
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (one pass, no cumsum search).
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise).item())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    # Keep the smallest set whose mass reaches top_p (the first token is always kept).
    drop = cumulative - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _request_seed(default_seed: int, request_id: str) -> int:
    return _hash64(f"{default_seed}:{request_id}")


def _token_seed(seed: int, index: int) -> int:
    return _hash64(f"{seed}:{index}")


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def compute_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Log-probabilities of the sampled tokens under the model's raw distribution, plus the top ones."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
    result = []
    for row, (value, k) in enumerate(zip(chosen, num_top)):
        top: list[tuple[int, float]] = []
        if k > 0:
            top_values, top_ids = torch.topk(logprobs[row], k)
            top = list(zip(top_ids.tolist(), top_values.tolist()))
        result.append(TokenLogprobs(logprob=value, top=top))
    return result
