"""POST /v1/batch-generate through the real gateway, router and simulated fixed-batch worker processes:
1,000 concurrent calls each get their own output; a worker killed with SIGKILL mid-batch has its batch run
again on the other and every call answered once; with two routers, the model's router killed mid-batch has its
calls sent to the other by the gateway; deadlines, auth, idempotency and errors as on other routes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from flotilla.rpc.router_ownership import owner_order
from flotilla.worker.fixed_batch.simulated import transform

from tests.fixed_batch.fleet import MODEL, start_batch_fleet
from tests.support.fleet import worker_load
from tests.support.waiting import wait_until


async def post_all(url: str, bodies: list[dict], headers: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/batch-generate", json=body, headers=h)
                                      for body, h in zip(bodies, headers)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with start_batch_fleet(tmp_path_factory.mktemp("fixed-batch"), num_workers=2,
                           worker_args=("--max-batch-size", "50", "--batch-latency-ms", "200")) as fleet:
        yield fleet


async def test_a_thousand_concurrent_calls_each_get_their_own_output(fleet):
    inputs = [f"call {i}: {'abc' * (i % 5)}" for i in range(1000)]
    headers = [fleet.headers("paid" if i % 2 else "free") for i in range(1000)]
    responses = await post_all(fleet.url, [{"model": MODEL, "input": text} for text in inputs], headers)
    assert Counter(r.status_code for r in responses) == {200: 1000}
    bodies = [r.json() for r in responses]
    assert [b["output"] for b in bodies] == [transform(text) for text in inputs]  # no cross-talk
    positions: dict[str, list[int]] = {}
    for body in bodies:
        batch = body["batch"]
        assert body["model"] == MODEL and body["object"] == "batch_generation" and batch["attempts"] == 1
        positions.setdefault(batch["id"], []).append(batch["index"])
        assert 1 <= batch["size"] <= 50
    for batch_id, indexes in positions.items():  # each batch's positions are 0..size-1, once each
        size = next(b["batch"]["size"] for b in bodies if b["batch"]["id"] == batch_id)
        assert sorted(indexes) == list(range(size))
    assert sum(len(i) for i in positions.values()) == 1000


def test_deadline_passed_while_waiting_is_a_504_without_running(fleet):
    # Alone, a call waits the flush wait T (500 - 2 * 200 = 100 ms): longer than its 20 ms deadline.
    response = httpx.post(f"{fleet.url}/v1/batch-generate", json={"model": MODEL, "input": "late"},
                          headers={**fleet.headers("paid"), "x-flotilla-deadline-ms": "20"}, timeout=30)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"


def test_auth_errors_and_unknown_models_in_the_documented_shape(fleet):
    url = f"{fleet.url}/v1/batch-generate"
    no_key = httpx.post(url, json={"model": MODEL, "input": "x"}, timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    unknown_field = httpx.post(url, json={"model": MODEL, "input": "x", "max_tokens": 3},
                               headers=fleet.headers("paid"), timeout=30)
    assert unknown_field.status_code == 400 and unknown_field.json()["error"]["param"] == "max_tokens"
    missing = httpx.post(url, json={"model": MODEL}, headers=fleet.headers("paid"), timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
    unknown_model = httpx.post(url, json={"model": "nope", "input": "x"}, headers=fleet.headers("paid"), timeout=30)
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["code"] == "model_not_found"


def test_an_idempotency_key_replays_the_first_answer(fleet):
    url = f"{fleet.url}/v1/batch-generate"
    headers = {**fleet.headers("paid"), "idempotency-key": "batch-once"}
    first = httpx.post(url, json={"model": MODEL, "input": "once"}, headers=headers, timeout=30)
    again = httpx.post(url, json={"model": MODEL, "input": "once"}, headers=headers, timeout=30)
    other = httpx.post(url, json={"model": MODEL, "input": "twice"}, headers=headers, timeout=30)
    assert first.status_code == again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true" and again.json() == first.json()
    assert other.status_code == 422


async def test_a_worker_killed_mid_batch_has_its_calls_answered_once_by_the_other(tmp_path):
    # L = 1.5 s leaves time to kill w0 while its batch runs; T = 50 ms sends the rest to w1 meanwhile.
    with start_batch_fleet(tmp_path, num_workers=2, worker_args=("--max-batch-size", "50", "--batch-latency-ms",
                                                                 "1500"),
                           router_args=("--batch-max-wait-ms", "50")) as fleet:
        inputs = [f"k{i}" for i in range(60)]
        task = asyncio.create_task(post_all(fleet.url, [{"model": MODEL, "input": t} for t in inputs],
                                            [fleet.headers("paid")] * 60))
        victim = fleet.workers[0]
        await asyncio.to_thread(wait_until, lambda: worker_load(victim).num_running == 1, 30, "w0 running a batch",
                                0.02)
        killed_at = time.monotonic()
        victim.kill()
        responses = await task
        assert time.monotonic() - killed_at < 10
        assert Counter(r.status_code for r in responses) == {200: 60}
        bodies = [r.json() for r in responses]
        assert [b["output"] for b in bodies] == [transform(t) for t in inputs]
        attempts = Counter((b["batch"]["worker_id"], b["batch"]["attempts"]) for b in bodies)
        assert attempts[("w1", 2)] >= 1 and all(worker == "w1" for worker, _ in attempts)  # w0 never answered
        assert sum(attempts.values()) == 60
        assert "w0" not in fleet.healthy_worker_ids()


async def test_the_models_router_killed_mid_batch_has_its_calls_answered_by_the_other(tmp_path):
    with start_batch_fleet(tmp_path, num_workers=1, num_routers=2,
                           worker_args=("--max-batch-size", "50", "--batch-latency-ms", "1000")) as fleet:
        owner_address = owner_order([r.address for r in fleet.routers], MODEL)[0]
        (owner,) = [r for r in fleet.routers if r.address == owner_address]
        inputs = [f"r{i}" for i in range(40)]
        task = asyncio.create_task(post_all(fleet.url, [{"model": MODEL, "input": t} for t in inputs],
                                            [fleet.headers("paid")] * 40))
        worker = fleet.workers[0]
        await asyncio.to_thread(wait_until, lambda: worker_load(worker).num_running == 1, 30,
                                "the worker running the owner's batch", 0.02)
        owner.kill()
        responses = await task
        assert Counter(r.status_code for r in responses) == {200: 40}
        assert [r.json()["output"] for r in responses] == [transform(t) for t in inputs]
