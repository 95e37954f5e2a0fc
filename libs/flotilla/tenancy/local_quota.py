"""The same quotas in this process's memory: `flotilla up` without Redis, and the fail-open fallback
while Redis is down (limits then hold per gateway process, not across the fleet)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from flotilla.tenancy.quota import (CONCURRENCY_LEASE_S, CONCURRENCY_RETRY_S, WINDOW_S, Decision, QuotaState,
                                    Reason, Usage)
from flotilla.tenancy.records import Limits


@dataclass
class _Window:
    log: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)  # id -> (time, tokens), oldest first
    num_tokens: int = 0
    in_flight: dict[str, float] = field(default_factory=dict)  # id -> lease expiry


class LocalQuotaStore:
    def __init__(self, window_s: float = WINDOW_S, lease_s: float = CONCURRENCY_LEASE_S,
                 clock: Callable[[], float] = time.monotonic):
        self._window_s = window_s
        self._lease_s = lease_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    async def reserve(self, tenant: str, reservation_id: str, num_tokens: int, limits: Limits) -> Decision:
        now = self._clock()
        w = self._slide(tenant, now)
        reason, retry_s = self._refusal(w, num_tokens, limits, now)
        if not reason:
            w.log[reservation_id] = (now, num_tokens)
            w.num_tokens += num_tokens
            if limits.max_concurrent:
                w.in_flight[reservation_id] = now + self._lease_s
        return Decision(not reason, reason, max(0.0, retry_s), self._state(w, limits, now))

    async def settle(self, tenant: str, reservation_id: str, num_used_tokens: int) -> int:
        w = self._windows.get(tenant)
        if w is None:
            return 0
        w.in_flight.pop(reservation_id, None)
        held = w.log.get(reservation_id)
        if held is None or held[1] <= num_used_tokens:
            return 0
        refund = held[1] - num_used_tokens
        w.log[reservation_id] = (held[0], num_used_tokens)
        w.num_tokens -= refund
        return refund

    async def usage(self, tenant: str) -> Usage:
        w = self._windows.get(tenant) or _Window()
        return Usage(w.num_tokens, len(w.log), len(w.in_flight))

    def _slide(self, tenant: str, now: float) -> _Window:
        w = self._windows.setdefault(tenant, _Window())
        while w.log:
            rid, (at, tokens) = next(iter(w.log.items()))
            if at > now - self._window_s:
                break
            del w.log[rid]
            w.num_tokens -= tokens
        while w.in_flight:  # insertion order is expiry order (one lease length)
            rid, expiry = next(iter(w.in_flight.items()))
            if expiry > now:
                break
            del w.in_flight[rid]
        return w

    def _refusal(self, w: _Window, cost: int, limits: Limits, now: float) -> tuple[str, float]:
        tpm, rpm = limits.tokens_per_minute, limits.requests_per_minute
        if tpm and cost > tpm:
            return Reason.TOO_LARGE, 0.0
        if limits.max_concurrent and len(w.in_flight) >= limits.max_concurrent:
            return Reason.CONCURRENCY, CONCURRENCY_RETRY_S
        if rpm and len(w.log) >= rpm:
            entries = list(w.log.values())
            return Reason.REQUESTS, entries[len(entries) - rpm][0] + self._window_s - now
        if tpm and w.num_tokens + cost > tpm:
            need, freeing = w.num_tokens + cost - tpm, 0
            for at, tokens in w.log.values():
                freeing += tokens
                if freeing >= need:
                    return Reason.TOKENS, at + self._window_s - now
        return "", 0.0

    def _state(self, w: _Window, limits: Limits, now: float) -> QuotaState:
        if not w.log:
            return QuotaState(limits, w.num_tokens, 0, 0.0, 0.0)
        newest, oldest = next(reversed(w.log.values())), next(iter(w.log.values()))
        return QuotaState(limits, w.num_tokens, len(w.log), newest[0] + self._window_s - now,
                          oldest[0] + self._window_s - now)
