"""Quota decisions and reservations, shared by the Redis and in-process stores.

At admission a request reserves prompt tokens + max_tokens in the tenant's sliding one-minute window
(and one request, and one concurrency slot); at completion it settles: what was not generated is
refunded and its concurrency slot is released. Both stores implement the same algorithm (a log of
reservations in the window plus a running sum), so accounting is exact, not approximate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flotilla.tenancy.records import Limits

WINDOW_S = 60.0
# A concurrency slot a gateway never released (it crashed) is freed after this long.
CONCURRENCY_LEASE_S = 600.0
# Over the concurrency limit nothing says when a slot frees up: ask the client to retry after this.
CONCURRENCY_RETRY_S = 1.0


class Reason:
    TOKENS = "tokens"
    REQUESTS = "requests"
    CONCURRENCY = "concurrency"
    TOO_LARGE = "too_large"  # more tokens than the per-minute limit: can never be admitted


@dataclass(frozen=True)
class QuotaState:
    """The tenant's window after a decision, for the rate-limit headers."""

    limits: Limits
    num_tokens_used: int
    num_requests_used: int
    tokens_reset_s: float  # until enough of the window expires for this request (or the oldest entry)
    requests_reset_s: float

    @property
    def tokens_remaining(self) -> int:
        return max(0, self.limits.tokens_per_minute - self.num_tokens_used)

    @property
    def requests_remaining(self) -> int:
        return max(0, self.limits.requests_per_minute - self.num_requests_used)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # "" when allowed, else a Reason
    retry_after_s: float
    state: QuotaState


@dataclass(frozen=True)
class Usage:
    num_tokens: int  # in the window now
    num_requests: int
    num_in_flight: int


class QuotaStore(Protocol):
    async def reserve(self, tenant: str, reservation_id: str, num_tokens: int, limits: Limits) -> Decision: ...

    async def settle(self, tenant: str, reservation_id: str, num_used_tokens: int) -> int:
        """Refund reserved-but-unused tokens and release the concurrency slot; returns tokens refunded."""
        ...

    async def usage(self, tenant: str) -> Usage: ...
