"""Degradation before refusal through the real fleet (router, one worker, a gateway process, real Redis):
open-loop load at ~3x capacity of paid, free and batch requests, each with a deadline.

Paid requests all but never fail; free requests are degraded (max_tokens capped, told in
x-flotilla-degraded, their token quota tightened with the load) before any of them is refused; batch and then
free are shed with 529; and every request is answered (a result or an error) well before its deadline.
Latency figures are printed; timing comparisons belong to loadtest/, not here.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.fleet import MODEL, Fleet

FREE_CAP = 8  # --degrade-free-max-tokens
MAX_TOKENS = 32
FREE_TPM = 200_000  # the free key's static limit: only the degradation's tightening can bind
DEADLINE_S = 20.0
PROMPT = list(range(30, 44))  # 14 tokens


@pytest.fixture(scope="module")
def degrading_url(tenancy_fleet: Fleet) -> str:
    """One more gateway on the tenancy fleet (its router, worker and Redis), degrading early: onset at 0.3 s of
    backlog, free shed at 1 s, batch at 0.5 s (the fleet's budgets)."""
    gateway = tenancy_fleet.add_gateway("--redis-fail-mode", "closed", "--wait-budget-free-s", "1.0",
                                        "--wait-budget-batch-s", "0.5", "--degrade-onset-s", "0.3",
                                        "--degrade-free-max-tokens", str(FREE_CAP), "--queue-load-interval-s", "0.1")
    yield f"http://127.0.0.1:{gateway.port}"
    tenancy_fleet.gateways.remove(gateway)
    gateway.stop()


async def post(client: httpx.AsyncClient, url: str, key: str) -> tuple[float, float, httpx.Response]:
    """(sent at, seconds to the answer, the answer)."""
    sent = time.perf_counter()
    response = await client.post(f"{url}/v1/completions",
                                 headers={"authorization": f"Bearer {key}",
                                          "x-flotilla-deadline-ms": str(int(DEADLINE_S * 1000))},
                                 json={"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                       "ignore_eos": True})
    return sent, time.perf_counter() - sent, response


async def test_at_3x_capacity_free_is_degraded_before_refused_and_paid_succeeds(tenancy_fleet, degrading_url):
    paid = tenancy_fleet.create_key("paid-deg")
    free = tenancy_fleet.create_key("free-deg", "--tier", "free", "--tokens-per-minute", str(FREE_TPM))
    batch = tenancy_fleet.create_key("batch-deg", "--priority-class", "batch")
    urls = [degrading_url]
    async with httpx.AsyncClient(timeout=DEADLINE_S + 30, limits=httpx.Limits(max_connections=1000)) as client:
        start = time.perf_counter()
        warmup = await asyncio.gather(*(post(client, urls[0], paid) for i in range(32)))
        capacity_rps = len(warmup) / (time.perf_counter() - start)
        assert all(r.status_code == 200 for _, _, r in warmup)
        rate, duration_s = 3 * capacity_rps, 5.0
        mix = [("paid", paid), ("free", free), ("batch", batch), ("free", free), ("batch", batch)]
        tasks, kinds = [], []
        for i in range(int(rate * duration_s)):
            kind, key = mix[i % 5]
            kinds.append(kind)
            tasks.append(asyncio.create_task(post(client, urls[0], key)))
            await asyncio.sleep(1 / rate)  # arrival pacing of the open-loop load, not a wait for a condition
        answers = await asyncio.gather(*tasks)
    by_kind: dict[str, list[tuple[float, float, httpx.Response]]] = {"paid": [], "free": [], "batch": []}
    for kind, answer in zip(kinds, answers):
        by_kind[kind].append(answer)
    statuses = {k: sorted({r.status_code for _, _, r in v}) for k, v in by_kind.items()}
    success = {k: sum(r.status_code == 200 for _, _, r in v) / len(v) for k, v in by_kind.items()}
    free_degraded = [(t, r) for t, _, r in by_kind["free"] if "x-flotilla-degraded" in r.headers]
    slowest = max(s for _, s, _ in answers)
    print(f"\ncapacity ~{capacity_rps:.0f} req/s, offered {rate:.0f} req/s for {duration_s} s: statuses {statuses}, "
          f"success {success}, free degraded {len(free_degraded)}/{len(by_kind['free'])}, slowest answer "
          f"{slowest:.1f} s")

    assert success["paid"] >= 0.99
    assert slowest < DEADLINE_S  # every request answered, none left waiting to its deadline
    for _, seconds, response in answers:
        assert response.status_code in (200, 429, 529), response.text
        if response.status_code in (429, 529):
            assert int(response.headers["retry-after"]) >= 1
            assert seconds < 5.0  # a refusal comes at admission, not after a wait
    # Free: degraded first. Its first refusal (529 shed, or 429 from the tightened quota) comes after its
    # first degraded answer, and degraded answers stop at the cap and say so.
    assert free_degraded, "no free request was degraded"
    refused_at = [t for t, _, r in by_kind["free"] if r.status_code in (429, 529)]
    assert not refused_at or min(t for t, _ in free_degraded) < min(refused_at)
    served = [r for _, r in free_degraded if r.status_code == 200]
    assert served, "no degraded free request was served"
    for response in served:
        body = response.json()
        assert body["usage"]["completion_tokens"] == FREE_CAP and body["choices"][0]["finish_reason"] == "length"
        assert f"max_tokens={FREE_CAP}" in response.headers["x-flotilla-degraded"]
    tightened = [int(r.headers["x-ratelimit-limit-tokens"]) for _, r in free_degraded if r.status_code == 200]
    assert min(tightened) < FREE_TPM  # the quota followed the load, not a static bucket
    for _, _, response in by_kind["paid"] + by_kind["batch"]:
        assert "x-flotilla-degraded" not in response.headers  # only the free tier is degraded
    assert any(r.status_code == 529 for _, _, r in by_kind["batch"]), "no batch request was shed"
