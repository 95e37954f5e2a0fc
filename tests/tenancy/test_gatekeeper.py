"""The Redis-down policy with a real Redis that is stopped and started again: fail-closed refuses,
fail-open carries on with remembered keys and local limits; both recover on their own."""

from __future__ import annotations

import pytest

from flotilla.tenancy.errors import BackendUnavailable
from flotilla.tenancy.gatekeeper import FailMode, Gatekeeper, QuotaExceeded
from flotilla.tenancy.key_hashing import generate_key, hash_key
from flotilla.tenancy.records import Limits, TenantKey
from flotilla.tenancy.redis_conn import connect
from flotilla.tenancy.redis_keys import RedisKeyStore
from flotilla.tenancy.redis_quota import RedisQuotaStore

from tests.support.waiting import async_wait_until


def make_gatekeeper(url: str, mode: FailMode) -> Gatekeeper:
    client = connect(url, timeout_s=0.5)
    return Gatekeeper(RedisKeyStore(client), RedisQuotaStore(client), client, mode, retry_interval_s=0.1)


@pytest.mark.parametrize("mode", [FailMode.CLOSED, FailMode.OPEN])
async def test_redis_outage_then_recovery(redis_server_factory, mode):
    server = redis_server_factory()
    gate = make_gatekeeper(server.url, mode)
    key = generate_key()
    entry = TenantKey("k", hash_key(key), "acme", limits=Limits(tokens_per_minute=100))
    await gate.keys.create(entry)
    assert await gate.authenticate(key) == entry
    held = await gate.reserve("acme", entry.limits, "r1", 60)

    server.stop()
    if mode is FailMode.CLOSED:
        with pytest.raises(BackendUnavailable):
            await gate.authenticate(key)
        with pytest.raises(BackendUnavailable):
            await gate.reserve("acme", entry.limits, "r2", 10)
    else:
        assert await gate.authenticate(key) == entry  # remembered
        with pytest.raises(BackendUnavailable):
            await gate.authenticate(generate_key())  # never seen: cannot be checked
        local = await gate.reserve("acme", entry.limits, "r2", 100)  # local limits: a fresh window in this process
        with pytest.raises(QuotaExceeded):
            await gate.reserve("acme", entry.limits, "r3", 1)
        await gate.settle(local, 0)
    assert gate.degraded and not await gate.check()
    await gate.settle(held, 10)  # Redis down: logged, never raised

    server.start()  # same port, data saved at the stop
    await async_wait_until(gate.check, 10, "the gatekeeper to reach Redis again", interval_s=0.05)
    assert not gate.degraded
    assert await gate.authenticate(key) == entry
    with pytest.raises(QuotaExceeded):  # r1's 60 tokens are still in the shared window
        await gate.reserve("acme", entry.limits, "r4", 41)
    assert (await gate.reserve("acme", entry.limits, "r5", 40)).decision.allowed
    await gate.close()
