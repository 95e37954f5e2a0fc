"""Pending calls of one fixed-batch model, pure (no clocks, no I/O): one FIFO per tier, paid before every
other tier; the size-or-time flush rule; a batch taken paid first, with calls past their deadline dropped
before they could be dispatched.

Calls are taken only when a worker is idle (the dispatcher asks `is_due` then `take`), so a batch is formed at
the moment it leaves: a paid call that arrives while every worker is busy still goes ahead of free calls that
arrived before it, and a batch fills while it waits for a worker.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

PAID = "paid"


@dataclass(eq=False, slots=True)
class PendingCall:
    """One caller waiting for one output. `resolve` is called exactly once (BatchDispatcher._resolve)."""

    call_id: int
    input: str
    tier: str
    arrived_s: float  # monotonic
    resolve: Callable[[object], None]
    deadline_s: float = math.inf  # monotonic; past it the call is dropped before dispatch
    give_up_s: float = math.inf  # monotonic; past it, never dispatched, the call fails (no worker took it)
    request_id: str = ""
    resolved: bool = False
    cancelled: bool = False  # the caller went away: skipped if still queued, its answer dropped

    @property
    def is_live(self) -> bool:
        return not (self.resolved or self.cancelled)


@dataclass
class TakenBatch:
    calls: list[PendingCall]  # paid first, each tier in arrival order
    expired: list[PendingCall] = field(default_factory=list)  # past their deadline: answer DEADLINE_EXCEEDED


class TierQueues:
    """One model's pending calls. `tier_order` ranks tiers (earlier first); an unknown tier ranks last."""

    def __init__(self, tier_order: Sequence[str] = (PAID, "free")):
        self._order = list(tier_order)
        self._queues: dict[str, deque[PendingCall]] = {tier: deque() for tier in self._order}
        self._other: deque[PendingCall] = deque()
        self._num_live = 0

    def __len__(self) -> int:
        """Calls still waiting (cancelled ones no longer count)."""
        return self._num_live

    def add(self, call: PendingCall) -> None:
        self._queues.get(call.tier, self._other).append(call)
        self._num_live += 1

    def cancel(self, call: PendingCall) -> None:
        """Mark a queued call cancelled; it is skipped (and forgotten) when reached."""
        if call.is_live:
            call.cancelled = True
            self._num_live -= 1

    def oldest_arrival_s(self) -> float | None:
        heads = [queue[0].arrived_s for queue in self._tier_queues() if self._drop_dead_heads(queue)]
        return min(heads) if heads else None

    def is_due(self, now_s: float, max_batch_size: int, max_wait_s: float) -> bool:
        """Size or time: B calls wait, or the oldest has waited max_wait_s."""
        if self._num_live >= max_batch_size:
            return True
        oldest = self.oldest_arrival_s()
        return oldest is not None and now_s - oldest >= max_wait_s

    def next_due_s(self, max_wait_s: float) -> float | None:
        """When the oldest call will have waited max_wait_s (None: nothing waits)."""
        oldest = self.oldest_arrival_s()
        return None if oldest is None else oldest + max_wait_s

    def take(self, max_batch_size: int, now_s: float) -> TakenBatch:
        """Up to max_batch_size live calls, tier by tier (paid first); calls past their deadline met on the way
        are dropped into `expired` instead."""
        taken = TakenBatch([])
        for queue in self._tier_queues():
            while queue and len(taken.calls) < max_batch_size:
                call = queue.popleft()
                if not call.is_live:
                    continue
                self._num_live -= 1
                (taken.expired if call.deadline_s <= now_s else taken.calls).append(call)
        return taken

    def expire(self, now_s: float) -> list[PendingCall]:
        """Remove every call past its deadline or give-up time (the caller answers them); forget cancelled ones."""
        dropped = []
        for queue in self._tier_queues():
            if not any(not c.is_live or min(c.deadline_s, c.give_up_s) <= now_s for c in queue):
                continue
            kept = deque()
            for call in queue:
                if not call.is_live:
                    continue
                if min(call.deadline_s, call.give_up_s) <= now_s:
                    dropped.append(call)
                    self._num_live -= 1
                else:
                    kept.append(call)
            queue.clear()
            queue.extend(kept)
        return dropped

    def drain(self) -> list[PendingCall]:
        """Every live call, removed (the router is stopping)."""
        calls = [call for queue in self._tier_queues() for call in queue if call.is_live]
        for queue in self._tier_queues():
            queue.clear()
        self._num_live = 0
        return calls

    def _tier_queues(self) -> Iterable[deque[PendingCall]]:
        yield from self._queues.values()
        yield self._other

    @staticmethod
    def _drop_dead_heads(queue: deque[PendingCall]) -> bool:
        while queue and not queue[0].is_live:
            queue.popleft()
        return bool(queue)
