"""Both quota stores (Redis Lua, in-process) against the same cases: reserve, refuse with the right
reason and Retry-After, settle refunds exactly, concurrency slots, the sliding window."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from flotilla.tenancy.local_quota import LocalQuotaStore
from flotilla.tenancy.quota import Reason
from flotilla.tenancy.records import Limits
from flotilla.tenancy.redis_conn import connect
from flotilla.tenancy.redis_quota import RedisQuotaStore

from tests.support.waiting import async_wait_until


@pytest.fixture(params=["redis", "local"])
async def store(request):
    if request.param == "local":
        yield LocalQuotaStore()
        return
    client = connect(request.getfixturevalue("redis_url"))
    yield RedisQuotaStore(client)
    await client.aclose()


def rid() -> str:
    return uuid.uuid4().hex


async def test_reserve_until_the_token_limit_then_refuse_with_retry_after(store):
    limits = Limits(tokens_per_minute=1000)
    for _ in range(4):
        assert (await store.reserve("t", rid(), 250, limits)).allowed
    refused = await store.reserve("t", rid(), 1, limits)
    assert not refused.allowed and refused.reason == Reason.TOKENS
    assert 55 < refused.retry_after_s <= 60  # the oldest reservation leaves the window in about a minute
    assert refused.state.tokens_remaining == 0 and refused.state.num_requests_used == 4
    assert (await store.usage("t")).num_tokens == 1000
    assert (await store.usage("other")).num_tokens == 0


async def test_settle_refunds_exactly_what_was_not_used(store):
    limits = Limits(tokens_per_minute=1000)
    a, b = rid(), rid()
    assert (await store.reserve("t", a, 600, limits)).allowed
    assert not (await store.reserve("t", b, 500, limits)).allowed
    assert await store.settle("t", a, 150) == 450
    assert (await store.usage("t")).num_tokens == 150
    assert await store.settle("t", a, 150) == 0  # settling twice refunds nothing more
    decision = await store.reserve("t", b, 500, limits)
    assert decision.allowed and decision.state.num_tokens_used == 650 and decision.state.tokens_remaining == 350


async def test_request_and_too_large_limits(store):
    assert (await store.reserve("t", rid(), 5000, Limits(tokens_per_minute=1000))).reason == Reason.TOO_LARGE
    limits = Limits(requests_per_minute=3)
    assert all([(await store.reserve("r", rid(), 1, limits)).allowed for _ in range(3)])
    refused = await store.reserve("r", rid(), 1, limits)
    assert refused.reason == Reason.REQUESTS and refused.retry_after_s > 55


async def test_concurrency_slots_are_released_by_settle(store):
    limits = Limits(max_concurrent=2)
    first, second = rid(), rid()
    assert (await store.reserve("c", first, 10, limits)).allowed
    assert (await store.reserve("c", second, 10, limits)).allowed
    refused = await store.reserve("c", rid(), 10, limits)
    assert refused.reason == Reason.CONCURRENCY and refused.retry_after_s > 0
    await store.settle("c", first, 10)
    assert (await store.usage("c")).num_in_flight == 1
    assert (await store.reserve("c", rid(), 10, limits)).allowed


async def test_concurrent_reservations_never_overshoot(store):
    limits = Limits(tokens_per_minute=10_000)
    decisions = await asyncio.gather(*(store.reserve("burst", rid(), 300, limits) for _ in range(100)))
    assert sum(d.allowed for d in decisions) == 10_000 // 300
    assert (await store.usage("burst")).num_tokens == (10_000 // 300) * 300


async def test_the_window_slides():
    now = [1000.0]
    store = LocalQuotaStore(window_s=60, clock=lambda: now[0])
    limits = Limits(tokens_per_minute=100)
    assert (await store.reserve("t", "a", 60, limits)).allowed
    now[0] += 30
    assert (await store.reserve("t", "b", 40, limits)).allowed
    refused = await store.reserve("t", "c", 50, limits)
    assert refused.reason == Reason.TOKENS and refused.retry_after_s == pytest.approx(30)
    now[0] += 30.001  # "a" left the window
    assert (await store.reserve("t", "c", 50, limits)).allowed
    assert (await store.usage("t")).num_tokens == 90


async def test_redis_window_slides_on_redis_time(redis_url):
    client = connect(redis_url)
    store = RedisQuotaStore(client, window_s=0.3)
    limits = Limits(tokens_per_minute=100)
    assert (await store.reserve("t", rid(), 100, limits)).allowed
    refused = await store.reserve("t", rid(), 1, limits)
    assert not refused.allowed and 0 < refused.retry_after_s <= 0.3

    async def window_slid() -> bool:  # on Redis's clock: reserving succeeds once the 0.3 s window moved on
        return (await store.reserve("t", rid(), 1, limits)).allowed

    await async_wait_until(window_slid, 5, "the window to slide", interval_s=0.05)
    assert (await store.usage("t")).num_tokens == 1
    await client.aclose()
