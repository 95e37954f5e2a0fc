"""Recent traffic per model for the autoscaler: TTFT samples and the prompt/output token mix over a
sliding window (router-measured: time from Generate arrival to the first relayed token)."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_WINDOW_S = 300.0  # samples older than this are dropped whatever window is asked for


@dataclass(frozen=True)
class TrafficSnapshot:
    ttft_p95_s: float
    num_ttft_samples: int
    num_prompt_tokens: int
    num_output_tokens: int
    seconds_since_last_request: float  # since the last placed request, else since the window was made


@dataclass
class _ModelTraffic:
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)  # (at, seconds), one per request
    # Token counts per whole second, [second, tokens]: output is recorded for every relayed chunk, and one
    # entry per chunk made a 300 s window hold ~a million entries at a few thousand tokens per second.
    prompt_tokens: deque[list[int]] = field(default_factory=deque)
    output_tokens: deque[list[int]] = field(default_factory=deque)
    last_request_s: float | None = None  # when record_prompt was last called: the model's idle clock


class TrafficWindow:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._models: dict[str, _ModelTraffic] = {}
        self._started_s = clock()  # a model without requests since (a router restart) is idle since then

    def _model(self, name: str) -> _ModelTraffic:
        traffic = self._models.setdefault(name, _ModelTraffic())
        horizon = self._clock() - MAX_WINDOW_S
        for samples in (traffic.ttfts, traffic.prompt_tokens, traffic.output_tokens):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        return traffic

    def record_ttft(self, model: str, seconds: float) -> None:
        self._model(model).ttfts.append((self._clock(), seconds))

    def record_prompt(self, model: str, num_tokens: int) -> None:
        """One placed request of `num_tokens` prompt tokens."""
        traffic = self._model(model)
        traffic.last_request_s = self._clock()
        _count(traffic.prompt_tokens, traffic.last_request_s, num_tokens)

    def record_output(self, model: str, num_tokens: int) -> None:
        if num_tokens:
            _count(self._model(model).output_tokens, self._clock(), num_tokens)

    def snapshot(self, model: str, window_s: float) -> TrafficSnapshot:
        traffic = self._model(model)
        now = self._clock()
        since = now - window_s
        ttfts = sorted(seconds for at, seconds in traffic.ttfts if at >= since)
        return TrafficSnapshot(
            ttft_p95_s=_p95(ttfts),
            num_ttft_samples=len(ttfts),
            num_prompt_tokens=_counted_since(traffic.prompt_tokens, since),
            num_output_tokens=_counted_since(traffic.output_tokens, since),
            seconds_since_last_request=now - (self._started_s if traffic.last_request_s is None
                                              else traffic.last_request_s),
        )


def _count(buckets: deque[list[int]], at: float, num_tokens: int) -> None:
    second = math.floor(at)
    if buckets and buckets[-1][0] == second:
        buckets[-1][1] += num_tokens
    else:
        buckets.append([second, num_tokens])


def _counted_since(buckets: deque[list[int]], since: float) -> int:
    """Tokens in the buckets from the one holding `since` on (the window's start is whole-second exact)."""
    first = math.floor(since)
    return sum(n for second, n in buckets if second >= first)


def _p95(sorted_values: list[float]) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, math.ceil(0.95 * len(sorted_values)) - 1)]
