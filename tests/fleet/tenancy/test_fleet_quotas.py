"""Quotas through the real fleet: three gateway processes share one Redis. Limits hold exactly across
them, refunds are exact, 429s carry Retry-After and each dialect's rate-limit headers, a revoked key is
refused at once everywhere, and a Redis outage is handled as configured, then recovered from."""

from __future__ import annotations

import asyncio

import httpx

from flotilla.tenancy.redis_conn import connect
from flotilla.tenancy.redis_quota import RedisQuotaStore

from tests.support.fleet import MODEL, Fleet
from tests.support.waiting import async_wait_until, wait_until

PROMPT = list(range(10, 20))  # token ids: the prompt costs exactly 10 tokens


async def complete(client: httpx.AsyncClient, url: str, key: str, max_tokens: int = 4) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                             json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})


async def burst(fleet: Fleet, key: str, n: int, max_tokens: int = 4) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(complete(client, fleet.urls[i % 3], key, max_tokens) for i in range(n)))


async def usage_of(fleet: Fleet, tenant: str):
    client = connect(fleet.redis.url)
    try:
        return await RedisQuotaStore(client).usage(tenant)
    finally:
        await client.aclose()


async def test_requests_per_minute_hold_exactly_across_three_gateways(tenancy_fleet):
    key = tenancy_fleet.create_key("rpm", "--requests-per-minute", "10")
    responses = await burst(tenancy_fleet, key, 30)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 10 + [429] * 20
    for refused in (r for r in responses if r.status_code == 429):
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-requests"] == "10"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.json()["error"]["type"] == "rate_limit_error"


async def test_token_reservations_and_refunds_are_exact(tenancy_fleet):
    key = tenancy_fleet.create_key("tpm", "--tokens-per-minute", "1000")
    responses = await burst(tenancy_fleet, key, 40, max_tokens=40)  # reserves 10 + 40 = 50 tokens each
    ok = [r.json()["usage"] for r in responses if r.status_code == 200]
    assert len(ok) >= 1000 // 50  # refunds of unused max_tokens may let more in, never fewer
    assert all(r.status_code in (200, 429) for r in responses)
    used = sum(u["prompt_tokens"] + u["completion_tokens"] for u in ok)

    seen = []

    async def settled() -> bool:  # settlements run just after the responses
        seen.append(await usage_of(tenancy_fleet, "tpm"))
        return not seen[-1].num_in_flight and seen[-1].num_tokens == used

    await async_wait_until(settled, 10, lambda: f"the window to settle: holds {seen[-1]}, responses used {used}",
                           interval_s=0.05)
    assert seen[-1].num_tokens <= 1000 and seen[-1].num_requests == len(ok)


async def test_anthropic_headers_and_429(tenancy_fleet):
    key = tenancy_fleet.create_key("anthropic", "--tokens-per-minute", "100")
    body = {"model": MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=60) as client:
        first = await client.post(f"{tenancy_fleet.urls[1]}/v1/messages", headers={"x-api-key": key}, json=body)
        second = await client.post(f"{tenancy_fleet.urls[2]}/v1/messages", headers={"x-api-key": key}, json=body)
    assert first.status_code == 200
    assert first.headers["anthropic-ratelimit-tokens-limit"] == "100"
    assert int(first.headers["anthropic-ratelimit-tokens-remaining"]) < 100
    assert first.headers["anthropic-ratelimit-tokens-reset"].endswith("Z")
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert "anthropic-ratelimit-tokens-remaining" in second.headers


def test_revoked_key_is_refused_at_once_by_every_gateway(tenancy_fleet):
    key = tenancy_fleet.create_key("revoked", "--key-id", "to-revoke")
    headers = {"x-api-key": key}
    assert [httpx.get(f"{url}/v1/models", headers=headers).status_code for url in tenancy_fleet.urls] == [200] * 3
    assert tenancy_fleet.keys_command("revoke", "to-revoke") == 0
    assert [httpx.get(f"{url}/v1/models", headers=headers).status_code for url in tenancy_fleet.urls] == [401] * 3


def _status(url: str, key: str) -> int:
    return httpx.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code


def test_redis_outage_then_automatic_recovery(tenancy_fleet):
    """Last in the package on purpose: it stops the fleet's Redis (and starts it again)."""
    key = tenancy_fleet.create_key("outage", "--tokens-per-minute", "100000")
    closed, _, opened = tenancy_fleet.urls
    assert _status(closed, key) == 200 and _status(opened, key) == 200  # the fail-open gateway saw the key
    tenancy_fleet.redis.stop()
    try:
        assert _status(closed, key) == 503
        assert _status(opened, key) == 200  # remembered key, local limits
        assert httpx.get(f"{closed}/healthz").json()["status"] == "degraded"
        ready = httpx.get(f"{closed}/readyz")
        assert ready.status_code == 503 and ready.json()["redis"] == "unreachable"
        open_ready = httpx.get(f"{opened}/readyz")
        assert open_ready.status_code == 200 and open_ready.json()["status"] == "degraded"
    finally:
        tenancy_fleet.redis.start()
    wait_until(lambda: _status(closed, key) == 200, 15, "the fail-closed gateway to recover", interval_s=0.05)
    for url in tenancy_fleet.urls:
        wait_until(lambda url=url: httpx.get(f"{url}/healthz").json()["status"] == "ok", 15, f"{url} healthy",
                   interval_s=0.05)


async def test_one_tenants_prompt_never_hits_another_tenants_prefix_cache(tenancy_fleet):
    """The engine's prefix cache is salted per tenant (the key's cache salt, else its tenant): the same prompt from
    another tenant is computed afresh, while the first tenant's repeat hits its own cached blocks."""
    first, other = tenancy_fleet.create_key("cache-a"), tenancy_fleet.create_key("cache-b")
    prompt = list(range(300, 300 + 320))  # two whole 128-token blocks (a CPU worker's default); no other test sends it

    async def cached_tokens(client: httpx.AsyncClient, key: str) -> int:
        answer = await client.post(f"{tenancy_fleet.urls[0]}/v1/completions", headers={"authorization": f"Bearer {key}"},
                                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert answer.status_code == 200, answer.text
        return (answer.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    async with httpx.AsyncClient(timeout=60) as client:
        assert await cached_tokens(client, first) == 0
        assert await cached_tokens(client, first) > 0  # the cache works: the same tenant's repeat hits it
        assert await cached_tokens(client, other) == 0  # another tenant's identical prompt does not
        assert await cached_tokens(client, other) > 0
