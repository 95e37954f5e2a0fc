"""Fleet admission estimates: how long a request would wait, and whether that is beyond its budget.

Estimated wait = tokens queued ahead of the request (its class and the classes served before it) /
measured fleet throughput (tokens per second the workers processed while they had work). Throughput is
measured, not configured, so the shedding point follows what the fleet actually does. The budget comes
from the request's class and tier; because batch waits behind everything interactive and has the
smallest budget, batch is shed first, then free, then paid.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdmissionPolicy:
    """Per tier and class: the longest estimated queue wait a request may face at admission (seconds),
    its default deadline (0 = none) and its weight in fair queueing."""

    interactive_paid_s: float = 30.0
    interactive_free_s: float = 5.0
    batch_s: float = 2.0
    paid_deadline_s: float = 0.0
    free_deadline_s: float = 0.0
    paid_weight: int = 4
    free_weight: int = 1

    def __post_init__(self) -> None:
        for name in ("interactive_paid_s", "interactive_free_s", "batch_s", "paid_weight", "free_weight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.paid_deadline_s < 0 or self.free_deadline_s < 0:
            raise ValueError("default deadlines must be >= 0")

    def budget_s(self, tier: str, priority_class: str) -> float:
        if priority_class == "batch":
            return self.batch_s
        return self.interactive_paid_s if tier == "paid" else self.interactive_free_s

    def deadline_s(self, tier: str) -> float:
        return self.paid_deadline_s if tier == "paid" else self.free_deadline_s

    def weight(self, tier: str) -> int:
        return self.paid_weight if tier == "paid" else self.free_weight


@dataclass
class _Rate:
    last_total: int
    last_at: float
    last_busy: bool
    tokens_per_s: float = 0.0


@dataclass
class ThroughputMeter:
    """Per worker, tokens/s over report intervals in which it had work, smoothed (EWMA); idle intervals
    add no sample, so an idle fleet keeps the throughput it showed when busy."""

    alpha: float = 0.3
    clock: Callable[[], float] = time.monotonic
    _rates: dict[str, _Rate] = field(default_factory=dict)

    def observe(self, worker_id: str, num_tokens_total: int, busy: bool, at: float | None = None) -> None:
        """One load report: cumulative tokens processed, whether it has work, when it was taken
        (`at`; the same report observed twice adds nothing)."""
        now = self.clock() if at is None else at
        rate = self._rates.get(worker_id)
        if rate is None or num_tokens_total < rate.last_total:  # new or restarted worker
            self._rates[worker_id] = _Rate(num_tokens_total, now, busy)
            return
        elapsed = now - rate.last_at
        if elapsed <= 0:
            return
        if (busy or rate.last_busy) and num_tokens_total > rate.last_total:
            sample = (num_tokens_total - rate.last_total) / elapsed
            rate.tokens_per_s = sample if rate.tokens_per_s == 0 else (
                self.alpha * sample + (1 - self.alpha) * rate.tokens_per_s)
        rate.last_total, rate.last_at, rate.last_busy = num_tokens_total, now, busy

    def forget(self, worker_id: str) -> None:
        self._rates.pop(worker_id, None)

    def tokens_per_s(self, worker_ids: Iterable[str]) -> float:
        return sum(self._rates[w].tokens_per_s for w in worker_ids if w in self._rates)


def estimated_wait_s(num_tokens_ahead: int, tokens_per_s: float) -> float | None:
    """None while throughput is unmeasured (a cold fleet sheds nothing)."""
    if tokens_per_s <= 0:
        return None
    return num_tokens_ahead / tokens_per_s


def overload_retry_after_s(wait_s: float, budget_s: float) -> float:
    """Time for the queue to drain to the level where this request would be admitted, at least 1 s."""
    return max(1.0, math.ceil(wait_s - budget_s))
