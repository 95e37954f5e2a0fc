"""Token sampling for one step: greedy rows by argmax, the rest by temperature, top-k and top-p.

Randomness is stateless per token: a request's i-th output token is drawn with one uniform number derived
from (seed, i) alone. The same seed gives the same samples whatever else shares the batch, and a stream
resumed elsewhere at token i continues with the same uniform numbers. (Its tokens match as far as its logits do:
a resumed stream's come from a prefill, float32 rounding apart from the decode steps', which can move a CDF
boundary across a draw lying very close to it; loadtest/resume_margins.py measures how close.)

Sampled rows are drawn together by inverse CDF: one cumulative sum over the batch's probabilities and one
search per row. (A per-row torch.Generator filling a vocabulary of exponentials cost ~0.2 ms per token on a
CPU, more than the rest of a tiny model's decode step.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from flotilla.engine.device_copy import to_device
from flotilla.engine.request import Request
from flotilla.engine.scheduler_output import TokenLogprobs


def sample(logits: torch.Tensor, requests: Sequence[Request], default_seed: int) -> list[int]:
    """logits [N, V] float32, one row per request -> one token id per row."""
    return sample_ids(logits, requests, default_seed).tolist()


def sample_ids(logits: torch.Tensor, requests: Sequence[Request], default_seed: int) -> torch.Tensor:
    """sample()'s token ids as an int64 tensor [N] on the logits' device. Nothing waits for the device: every
    host-to-device copy is asynchronous and nothing is read back, so on a GPU the caller chooses when to copy the
    ids back (model_runner.PendingStep) and the host can go on meanwhile."""
    greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
    sampled = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
    if not sampled:
        return _argmax_rows(logits, None)
    token_ids = torch.empty(len(requests), dtype=torch.int64, device=logits.device)
    if greedy:
        token_ids[to_device(greedy, logits.device, torch.int64)] = _argmax_rows(logits, greedy)
    probs = _probabilities(logits, [requests[i] for i in sampled], sampled)
    uniforms = [_token_uniform(requests[i], default_seed) for i in sampled]
    token_ids[to_device(sampled, logits.device, torch.int64)] = _inverse_cdf(probs, uniforms)
    return token_ids


def _argmax_rows(logits: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """The first highest logit's index in each of `rows` (None: every row; torch's and numpy's argmax agree on
    ties). On a CPU through numpy: its vectorised argmax took 0.08 ms for 64 rows of 8,192 logits where torch's
    took 1.4 ms and the row gather 0.9 more, ~8% of a tiny model's decode step. Elsewhere on the device."""
    if logits.device.type == "cpu":
        array = logits.numpy()
        return torch.from_numpy((array if rows is None else array[rows]).argmax(axis=-1).astype("int64"))
    if rows is None:
        return logits.argmax(dim=-1)
    return logits[to_device(rows, logits.device, torch.int64)].argmax(dim=-1)


def _probabilities(logits: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> torch.Tensor:
    """[M, V] float64 probabilities after temperature, top-k and top-p, for the sampled rows."""
    temperatures = to_device([r.sampling_params.temperature for r in requests], logits.device, logits.dtype)
    scaled = logits[to_device(rows, logits.device, torch.int64)] / temperatures[:, None]
    for k, request in enumerate(requests):
        top_k = request.sampling_params.top_k
        if 0 < top_k < scaled.shape[1]:
            kth = torch.topk(scaled[k], top_k).values[-1]
            scaled[k].masked_fill_(scaled[k] < kth, float("-inf"))
    probs = torch.softmax(scaled.double(), dim=-1)
    for k, request in enumerate(requests):
        if request.sampling_params.top_p < 1.0:
            probs[k] = _top_p(probs[k], request.sampling_params.top_p)
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u x the row's total mass. A token
    with probability 0 never exceeds its predecessor's sum, so it is never drawn."""
    cdf = torch.cumsum(probs, dim=-1)
    targets = to_device(uniforms, cdf.device, cdf.dtype) * cdf[:, -1]
    picked = torch.searchsorted(cdf, targets[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    return picked[:, 0]


def _token_uniform(request: Request, default_seed: int) -> float:
    """U[0, 1) from (seed, output token index): the request's seed, or one derived from its id."""
    params = request.sampling_params
    seed = params.seed if params.seed is not None else _request_seed(default_seed, request.request_id)
    index = request.num_previous_output_tokens + request.num_output_tokens
    return (_token_seed(seed, index) >> 10) / float(1 << 53)  # _hash64 gives 63 bits: keep the top 53


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


class LogprobTensors(NamedTuple):
    """A step's log-probabilities on the device, for the rows that asked (logprob_tensors)."""

    chosen: torch.Tensor  # [W]: of the sampled token
    top_values: torch.Tensor  # [W, K], K the most any row asked for, highest first
    top_ids: torch.Tensor  # [W, K]


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, max_top: int) -> LogprobTensors:
    """Log-probabilities of the sampled tokens under the model's raw distribution, plus the top max_top of each row,
    computed on the logits' device with nothing read back (token_logprobs reads them)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    top_values, top_ids = torch.topk(logprobs, max_top, dim=-1)
    return LogprobTensors(chosen, top_values, top_ids)


def token_logprobs(tensors: LogprobTensors, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """The rows' TokenLogprobs from tensors on the host, each with its own number of top entries."""
    chosen, values, ids = tensors.chosen.tolist(), tensors.top_values.tolist(), tensors.top_ids.tolist()
    return [TokenLogprobs(logprob=value, top=list(zip(row_ids[:k], row_values[:k])))
            for value, row_values, row_ids, k in zip(chosen, values, ids, num_top)]
