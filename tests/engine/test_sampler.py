"""The sampler draws from the distribution it is given (frequencies over many seeded draws), never a token
that temperature, top-k or top-p removed, and the same (seed, index) gives the same token whatever shares
the batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from flotilla.engine.sampler import sample
from flotilla.engine.sampling_params import SamplingParams

PROBS = [0.5, 0.25, 0.15, 0.1, 0.0]
LOGITS = torch.tensor([math.log(p) if p else float("-inf") for p in PROBS], dtype=torch.float32)


def _request(index: int, seed: int | None = 1, request_id: str = "r", **params) -> SimpleNamespace:
    sampling = SamplingParams(max_tokens=16, temperature=params.pop("temperature", 1.0), seed=seed, **params)
    return SimpleNamespace(sampling_params=sampling, request_id=request_id, num_previous_output_tokens=0,
                           num_output_tokens=index)


def _draw(num: int, **params) -> list[int]:
    tokens = []
    for start in range(0, num, 500):  # batches of 500 rows, each a different output-token index
        requests = [_request(i, **params) for i in range(start, start + 500)]
        tokens += sample(LOGITS.repeat(len(requests), 1), requests, default_seed=0)
    return tokens


def test_frequencies_follow_the_probabilities_and_impossible_tokens_never_come():
    num = 20_000
    tokens = _draw(num)
    for token, p in enumerate(PROBS):
        count = tokens.count(token)
        sigma = math.sqrt(num * p * (1 - p))
        assert abs(count - num * p) <= 5 * sigma + 1, (token, count, num * p)
    assert 4 not in tokens


def test_temperature_top_k_and_top_p_shape_the_support():
    assert set(_draw(2_000, top_k=2)) == {0, 1}
    assert set(_draw(2_000, top_p=0.6)) == {0, 1}  # 0.5 alone does not reach 0.6; 0.5 + 0.25 does
    cold = _draw(2_000, temperature=0.05)
    assert cold.count(0) > 0.99 * len(cold)


def test_same_seed_and_index_same_token_whatever_shares_the_batch():
    alone = [sample(LOGITS[None], [_request(i, seed=42)], 0)[0] for i in range(50)]
    crowded = []
    for i in range(50):
        others = [_request(i, seed=s, request_id=f"o{s}") for s in range(7)]
        greedy = _request(i, seed=None, temperature=0.0)
        batch = [*others[:3], greedy, _request(i, seed=42), *others[3:]]
        crowded.append(sample(LOGITS.repeat(len(batch), 1), batch, 0)[4])
    assert crowded == alone
    assert [sample(LOGITS[None], [_request(i, seed=43)], 0)[0] for i in range(50)] != alone
