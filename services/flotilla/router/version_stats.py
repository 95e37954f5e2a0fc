"""Per-version request outcomes for comparing a rollout's candidate with the current version: one sample per
finished request (TTFT, TPOT, output tokens, outcome) over a sliding window, and requests in flight.

TTFT is router-measured (arrival to first relayed token, queue wait included); TPOT is the mean gap between
the request's relayed tokens after the first ((last - first) / (n - 1)).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

MAX_WINDOW_S = 3600.0
MAX_SAMPLES_PER_VERSION = 20_000  # bounds memory whatever the rate; the window then holds the newest ones


@dataclass(frozen=True)
class Sample:
    at: float
    outcome: str  # ok, cancelled or an error reason
    ttft_s: float | None  # None: no token was relayed
    tpot_s: float | None  # None: fewer than two tokens
    num_output_tokens: int


@dataclass(frozen=True)
class Summary:
    num_requests: int
    error_rate: float
    cancel_rate: float
    ttft_s: tuple[float, float, float]  # p50, p95, p99 (0 without samples)
    tpot_s: tuple[float, float, float]
    mean_output_tokens: float


class VersionStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._samples: dict[tuple[str, str], deque[Sample]] = {}
        self._inflight: Counter[tuple[str, str]] = Counter()

    def started(self, name: str, version: str) -> None:
        self._inflight[(name, version)] += 1

    def finished(self, name: str, version: str, outcome: str, ttft_s: float | None, tpot_s: float | None,
                 num_output_tokens: int) -> None:
        key = (name, version)
        self._inflight[key] -= 1
        if self._inflight[key] <= 0:
            del self._inflight[key]
        samples = self._samples.setdefault(key, deque(maxlen=MAX_SAMPLES_PER_VERSION))
        samples.append(Sample(self._clock(), outcome, ttft_s, tpot_s, num_output_tokens))
        horizon = self._clock() - MAX_WINDOW_S
        while samples and samples[0].at < horizon:
            samples.popleft()

    def num_inflight(self, name: str, version: str) -> int:
        return self._inflight.get((name, version), 0)

    def summary(self, name: str, version: str, window_s: float) -> Summary:
        since = self._clock() - window_s
        samples = [s for s in self._samples.get((name, version), ()) if s.at >= since]
        n = len(samples)
        outcomes = Counter(s.outcome for s in samples)
        num_errors = n - outcomes["ok"] - outcomes["cancelled"]
        return Summary(
            num_requests=n,
            error_rate=num_errors / n if n else 0.0,
            cancel_rate=outcomes["cancelled"] / n if n else 0.0,
            ttft_s=percentiles([s.ttft_s for s in samples if s.ttft_s is not None]),
            tpot_s=percentiles([s.tpot_s for s in samples if s.tpot_s is not None]),
            mean_output_tokens=sum(s.num_output_tokens for s in samples) / n if n else 0.0,
        )


def percentiles(values: list[float], points: tuple[float, ...] = (0.50, 0.95, 0.99)) -> tuple[float, ...]:
    """Nearest-rank percentiles; zeros without values."""
    if not values:
        return tuple(0.0 for _ in points)
    ordered = sorted(values)
    return tuple(ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))] for p in points)
