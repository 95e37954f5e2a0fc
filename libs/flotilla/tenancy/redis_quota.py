"""Token, request and concurrency quotas in Redis: one EVALSHA to reserve, one to settle."""

from __future__ import annotations

import redis.asyncio as aioredis

from flotilla.tenancy import quota_lua
from flotilla.tenancy.quota import CONCURRENCY_LEASE_S, CONCURRENCY_RETRY_S, WINDOW_S, Decision, QuotaState, Usage
from flotilla.tenancy.records import Limits
from flotilla.tenancy.redis_conn import KEY_PREFIX, call


def tenant_keys(tenant: str) -> list[str]:
    base = f"{KEY_PREFIX}quota:{{{tenant}}}:"
    return [base + "log", base + "amt", base + "sum", base + "conc"]


class RedisQuotaStore:
    def __init__(self, client: aioredis.Redis, window_s: float = WINDOW_S, lease_s: float = CONCURRENCY_LEASE_S):
        self.client = client
        self._window_ms = int(window_s * 1000)
        self._lease_ms = int(lease_s * 1000)
        # register_script: EVALSHA, and EVAL once more when Redis lost its script cache (a restart).
        self._reserve = client.register_script(quota_lua.RESERVE)
        self._settle = client.register_script(quota_lua.SETTLE)

    async def reserve(self, tenant: str, reservation_id: str, num_tokens: int, limits: Limits) -> Decision:
        args = [reservation_id, num_tokens, limits.tokens_per_minute, limits.requests_per_minute,
                limits.max_concurrent, self._window_ms, self._lease_ms, int(CONCURRENCY_RETRY_S * 1000)]
        allowed, reason, retry_ms, used, nreq, tokens_reset_ms, requests_reset_ms = await call(
            self._reserve(keys=tenant_keys(tenant), args=args))
        state = QuotaState(limits, int(used), int(nreq), tokens_reset_ms / 1000, requests_reset_ms / 1000)
        return Decision(bool(allowed), reason or "", max(0, int(retry_ms)) / 1000, state)

    async def settle(self, tenant: str, reservation_id: str, num_used_tokens: int) -> int:
        return int(await call(self._settle(keys=tenant_keys(tenant), args=[reservation_id, num_used_tokens])))

    async def usage(self, tenant: str) -> Usage:
        log, _, total, conc = tenant_keys(tenant)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.get(total)
            pipe.zcard(log)
            pipe.zcard(conc)
            num_tokens, num_requests, num_in_flight = await call(pipe.execute())
        return Usage(int(num_tokens or 0), int(num_requests), int(num_in_flight))
