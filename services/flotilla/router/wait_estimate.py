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


def with_load_time(wait_s: float | None, load_s: float | None) -> float | None:
    """The wait of a request whose model must first be loaded (a shared-pool model, shared_pool.py): the load
    comes before the queue drains onto it; known once either part is."""
    if not load_s:
        return wait_s
    return (wait_s or 0.0) + load_s


def starting_retry_after_s(load_s: float) -> float:
    """Retry-After for a model still loading: when its load should be done, at least 1 s."""
    return max(1.0, math.ceil(load_s))
