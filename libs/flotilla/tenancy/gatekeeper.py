"""The gateway's one entry point to tenancy: authenticate a key, reserve quota, settle it afterwards,
and what to do while Redis is down.

Redis down: "closed" refuses (the caller answers 503); "open" goes on with keys seen recently and quotas
held in this process (limits per gateway instead of fleet-wide). Either way the gatekeeper is
`degraded` until Redis answers again; after a failure it skips Redis for `retry_interval_s` (so a dead
Redis costs no timeout per request) and then tries again: recovery needs nobody.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis

from flotilla.tenancy.errors import BackendUnavailable
from flotilla.tenancy.file_keys import FileKeyStore
from flotilla.tenancy.key_hashing import hash_key
from flotilla.tenancy.key_store import KeyStore
from flotilla.tenancy.local_quota import LocalQuotaStore
from flotilla.tenancy.quota import Decision, QuotaStore
from flotilla.tenancy.records import Limits, TenantKey
from flotilla.tenancy.redis_conn import call, connect
from flotilla.tenancy.redis_keys import RedisKeyStore
from flotilla.tenancy.redis_quota import RedisQuotaStore

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_REMEMBERED_KEYS = 10_000


class FailMode(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class QuotaExceeded(Exception):
    def __init__(self, decision: Decision):
        super().__init__(f"quota exceeded ({decision.reason})")
        self.decision = decision


@dataclass(frozen=True)
class Reservation:
    tenant: str
    reservation_id: str
    num_tokens: int
    decision: Decision | None  # None: the tenant has no limits, nothing was reserved
    store: QuotaStore | None  # where it was made, so that it is settled there


class Gatekeeper:
    def __init__(self, keys: KeyStore, quotas: QuotaStore, redis: aioredis.Redis | None = None,
                 fail_mode: FailMode = FailMode.CLOSED, retry_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.keys = keys
        self.quotas = quotas
        self.redis = redis
        self.fail_mode = fail_mode
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._local_quotas = LocalQuotaStore(clock=clock)
        self._recent: OrderedDict[str, TenantKey] = OrderedDict()
        self._down_until = 0.0
        self._settling: set[asyncio.Task] = set()
        self.degraded = False

    # ---- requests ----------------------------------------------------------------------------------
    async def authenticate(self, api_key: str) -> TenantKey | None:
        digest = hash_key(api_key)
        try:
            entry = await self._guarded(lambda: self.keys.lookup(api_key))
        except BackendUnavailable:
            if self.fail_mode is FailMode.OPEN and digest in self._recent:
                return self._recent[digest]
            raise
        self._remember(digest, entry)
        return entry

    async def reserve(self, tenant: str, limits: Limits, reservation_id: str, num_tokens: int) -> Reservation:
        """Reserve prompt + max_tokens; raises QuotaExceeded, or BackendUnavailable when failing closed."""
        if limits.is_unlimited:
            return Reservation(tenant, reservation_id, num_tokens, None, None)
        store = self.quotas
        try:
            decision = await self._guarded(lambda: store.reserve(tenant, reservation_id, num_tokens, limits))
        except BackendUnavailable:
            if self.fail_mode is FailMode.CLOSED:
                raise
            store = self._local_quotas
            decision = await store.reserve(tenant, reservation_id, num_tokens, limits)
        if not decision.allowed:
            raise QuotaExceeded(decision)
        return Reservation(tenant, reservation_id, num_tokens, decision, store)

    def settle_soon(self, reservation: Reservation, num_used_tokens: int) -> None:
        """settle() in a task of its own: callers in a finally block (possibly cancelled) need not await."""
        if reservation.store is None:
            return
        task = asyncio.get_running_loop().create_task(self.settle(reservation, num_used_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def drain(self) -> None:
        """Wait for settlements in flight (tests, shutdown)."""
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)

    async def settle(self, reservation: Reservation, num_used_tokens: int) -> None:
        """Refund what was not used and free the concurrency slot; never raises (logged instead)."""
        if reservation.store is None:
            return
        try:
            await reservation.store.settle(reservation.tenant, reservation.reservation_id, num_used_tokens)
        except BackendUnavailable:
            self._mark_down()  # the slot's lease and the window expire it in Redis eventually
        except Exception:
            log.exception("settling reservation %s failed", reservation.reservation_id)

    # ---- health ------------------------------------------------------------------------------------
    async def check(self) -> bool:
        """Ping Redis (when used); True when healthy. Also clears the degraded state on recovery."""
        if self.redis is None:
            return True
        try:
            await call(self.redis.ping())
        except BackendUnavailable:
            self._mark_down()
            return False
        self._mark_up()
        return True

    async def close(self) -> None:
        await self.drain()
        await self.keys.close()
        if self.redis is not None:
            await self.redis.aclose()

    # ---- internals ---------------------------------------------------------------------------------
    async def _guarded(self, fn: Callable[[], Awaitable[T]]) -> T:
        if self.redis is not None and self._clock() < self._down_until:
            raise BackendUnavailable("redis is down (retrying shortly)")
        try:
            result = await fn()
        except BackendUnavailable:
            self._mark_down()
            raise
        if self.degraded:
            self._mark_up()
        return result

    def _mark_down(self) -> None:
        if not self.degraded:
            log.warning("redis unavailable: failing %s", self.fail_mode.value)
        self.degraded = True
        self._down_until = self._clock() + self._retry_interval_s

    def _mark_up(self) -> None:
        if self.degraded:
            log.warning("redis is back")
        self.degraded = False
        self._down_until = 0.0

    def _remember(self, digest: str, entry: TenantKey | None) -> None:
        if self.fail_mode is not FailMode.OPEN:
            return
        if entry is None:
            self._recent.pop(digest, None)
            return
        self._recent[digest] = entry
        self._recent.move_to_end(digest)
        if len(self._recent) > MAX_REMEMBERED_KEYS:
            self._recent.popitem(last=False)


def open_gatekeeper(redis_url: str | None, keys_file: str | None, fail_mode: FailMode = FailMode.CLOSED,
                    max_connections: int = 64) -> Gatekeeper:
    """Redis for keys and quotas when a URL is given, else the keys file with in-process quotas."""
    if redis_url:
        client = connect(redis_url, max_connections=max_connections)
        return Gatekeeper(RedisKeyStore(client), RedisQuotaStore(client), client, fail_mode)
    if keys_file is None:
        raise ValueError("need a Redis URL or a keys file")
    return Gatekeeper(FileKeyStore(keys_file), LocalQuotaStore())
