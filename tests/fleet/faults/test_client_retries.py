"""Client-side retries and reconnects against the real fleet (real Redis): Idempotency-Key replays (also
across a gateway killed and restarted mid-request: each request runs and is billed once), and resumable
streams (a reconnect with Last-Event-ID gets every event exactly once; no reconnect: cancelled after the
grace period)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from redis import Redis

from tests.support.fleet import MODEL, fleet_config, start_fleet
from tests.support.waiting import wait_until

from .conftest import KEY_ID, TENANT
from .sse_client import StreamResult, completion_body, read_events, stream_completion

GRACE_S = 2.0
RESUMABLE = {"x-flotilla-resumable": "true"}


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, tmp_path_factory, redis_server):
    redis_server.flush()
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("retries"), worker_args=["--num-kv-blocks", "512"],
                          gateway_args=["--stream-resume-grace-s", str(GRACE_S)], metrics=False)
    with start_fleet(config, redis=redis_server) as running:
        running.create_key(TENANT, key_id=KEY_ID)
        yield running


def _active_requests(fleet) -> list[str]:
    return list(fleet.worker_load().active_request_ids)


def _post(fleet, path: str, body: dict, key: str | None, **headers) -> httpx.Response:
    extra = {"idempotency-key": key} if key else {}
    return httpx.post(f"{fleet.url}{path}", json=body, headers={**fleet.headers, **extra, **headers}, timeout=60)


# ---- Idempotency-Key -------------------------------------------------------------------------------------
def test_retry_with_the_same_key_replays_without_running_again(fleet):
    before = len(fleet.ledger())
    body = completion_body([5, 6, 7, 8], 12, seed=3, stream=False)
    first = _post(fleet, "/v1/completions", body, "key-1")
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    again = _post(fleet, "/v1/completions", {**body}, "key-1")
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert len(fleet.wait_ledger(before + 1)) == before + 1  # billed once
    other = _post(fleet, "/v1/completions", {**body, "max_tokens": 11}, "key-1")
    assert other.status_code == 422 and other.json()["error"]["type"] == "invalid_request_error"
    anthropic = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(fleet, "/v1/messages", anthropic, "key-a").status_code == 200
    changed = _post(fleet, "/v1/messages", {**anthropic, "max_tokens": 6}, "key-a")
    assert changed.status_code == 422 and changed.json()["type"] == "error"  # Anthropic's error shape
    assert len(fleet.ledger()) == before + 2


async def test_unauthenticated_idempotency_keys_leave_nothing_in_the_store(fleet):
    """2,000 keys from callers without a (valid) API key: all 401, and the store holds none of them. (A request
    costs ~4 ms here, mostly the test's own httpx client and the gateway sharing two cores; the
    in-process flood of tests/gateway/test_idempotency_flood.py sends 10k.)"""
    body = completion_body([5, 6, 7], 4, stream=False)

    def idempotency_keys() -> int:
        with Redis.from_url(fleet.redis.url) as client:
            return sum(1 for _ in client.scan_iter(match="flotilla:idem:*", count=1000))

    before = idempotency_keys()
    # httpx's default pool (idle connections dropped after 5 s), as the SDKs have it: the gateway keeps idle
    # connections longer (keep_alive_s), so none is reused in the instant the gateway closes it (with uvicorn's
    # 5 s default this flood once met that ReadError in CI).
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
        async def one(i: int) -> int:
            auth = {"authorization": "Bearer fl-not-a-key"} if i % 2 else {}
            response = await client.post("/v1/completions", json=body, headers={"idempotency-key": f"anon-{i}", **auth})
            return response.status_code

        statuses = []
        for start in range(0, 2_000, 500):
            statuses += await asyncio.gather(*(one(i) for i in range(start, start + 500)))
    assert set(statuses) == {401}
    assert idempotency_keys() == before


async def test_concurrent_duplicates_wait_for_the_first(fleet):
    before = len(fleet.ledger())
    body = completion_body([9, 10, 11], 32, stream=False)
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(*(client.post(f"{fleet.url}/v1/completions", json=body,
                                                     headers={**fleet.headers, "idempotency-key": "dup"})
                                         for _ in range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert len({json.dumps(a.json(), sort_keys=True) for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 5
    fleet.wait_ledger(before + 1)
    assert len(fleet.ledger()) == before + 1


async def test_gateway_killed_and_restarted_each_request_runs_and_is_billed_once(fleet):
    before = {r.request_id for r in fleet.ledger()}
    bodies = {f"restart-{i}": completion_body([20 + i, 30, 40 + i], 200, seed=i, stream=False) for i in range(8)}

    async def call_until_answered(client: httpx.AsyncClient, key: str) -> httpx.Response:
        while True:  # what a client SDK does: retry connection errors and 5xx with the same key
            try:
                answer = await client.post(f"{fleet.url}/v1/completions", json=bodies[key],
                                           headers={**fleet.headers, "idempotency-key": key})
                if answer.status_code < 500:
                    return answer
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)

    async with httpx.AsyncClient(timeout=120) as client:
        calls = [asyncio.ensure_future(call_until_answered(client, key)) for key in bodies]
        await asyncio.to_thread(wait_until, lambda: len(_active_requests(fleet)) >= 4, 30, "requests running", 0.05)
        await asyncio.to_thread(fleet.restart_gateway)  # kill -9 mid-request, then start it again
        answers = await asyncio.wait_for(asyncio.gather(*calls), 120)
        replays = [await call_until_answered(client, key) for key in bodies]
    assert [a.status_code for a in answers] == [200] * len(bodies)
    assert [r.json() for r in replays] == [a.json() for a in answers]
    assert all(r.headers["idempotent-replayed"] == "true" for r in replays)
    new = [r for r in fleet.wait_ledger(len(before) + len(bodies)) if r.request_id not in before]
    assert len(new) == len(bodies) and {r.status for r in new} == {"ok"}  # the killed runs billed nothing
    assert sorted(r.output_tokens for r in new) == sorted(a.json()["usage"]["completion_tokens"] for a in answers)


# ---- resumable streams -----------------------------------------------------------------------------------
async def _read_until(client, fleet, body, headers, num_events: int) -> tuple[StreamResult, str]:
    """Open a resumable stream, read num_events events, then drop the connection."""
    result = StreamResult()
    async with client.stream("POST", f"{fleet.url}/v1/completions", json=body,
                             headers={**fleet.headers, **headers}) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-flotilla-stream-id"]
        result.request_id = response.headers["request-id"]

        async def stop_early(r: StreamResult) -> None:
            if len(r.event_ids) >= num_events:
                raise _Dropped()

        try:
            await read_events(response, result, stop_early)
        except _Dropped:
            pass
    return result, stream_id


class _Dropped(Exception):
    pass


@pytest.mark.parametrize("how", ["get", "post"])
async def test_reconnect_with_last_event_id_gets_every_event_once(fleet, how):
    body = completion_body([3, 1, 4, 1, 5, 9, 2, 6], 40, seed=11)
    async with httpx.AsyncClient(timeout=60) as client:
        whole = await stream_completion(client, fleet.url, fleet.headers, body)
        first, stream_id = await _read_until(client, fleet, body, RESUMABLE, 5)
        last = first.event_ids[-1]
        rest = StreamResult()
        if how == "get":
            request = client.stream("GET", f"{fleet.url}/v1/streams/{stream_id}",
                                    headers={**fleet.headers, "last-event-id": last})
        else:
            request = client.stream("POST", f"{fleet.url}/v1/completions", json=body,
                                    headers={**fleet.headers, "last-event-id": last})
        async with request as response:
            assert response.status_code == 200
            await read_events(response, rest)
    ids = first.event_ids + rest.event_ids
    assert ids == [f"{stream_id}.{n}" for n in range(1, len(ids) + 1)]  # every event, once, in order
    assert rest.done and first.text + rest.text == whole.text
    assert rest.completion_tokens == whole.completion_tokens


async def test_reconnect_needs_the_same_key_and_a_live_stream(fleet):
    body = completion_body([7, 7, 7], 8)
    async with httpx.AsyncClient(timeout=60) as client:
        first, stream_id = await _read_until(client, fleet, body, RESUMABLE, 1)
        stranger = await client.get(f"{fleet.url}/v1/streams/{stream_id}", headers={"x-api-key": "someone-else"})
        assert stranger.status_code == 404
        unknown = await client.get(f"{fleet.url}/v1/streams/nope", headers=fleet.headers)
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"


async def test_no_reconnect_within_the_grace_period_cancels(fleet):
    body = completion_body([8, 6, 7, 5, 3, 0, 9], 1500, seed=5)  # runs far longer than the grace period
    async with httpx.AsyncClient(timeout=60) as client:
        first, stream_id = await _read_until(client, fleet, body, RESUMABLE, 2)
        request_id = first.request_id
        assert request_id in _active_requests(fleet)  # still generating without a client
        await asyncio.to_thread(wait_until, lambda: request_id not in _active_requests(fleet), 10 * GRACE_S,
                                "the abort", 0.05)
        gone = await client.get(f"{fleet.url}/v1/streams/{stream_id}", headers=fleet.headers)
    assert gone.status_code == 404

    def record():
        return [r for r in fleet.ledger() if r.request_id == request_id]

    wait_until(lambda: record(), 10, "the cancelled request's usage record", interval_s=0.05)
    assert record()[0].status == "cancelled" and 0 < record()[0].output_tokens < 1500  # billed what was made


async def test_without_opt_in_there_is_no_stream_id(fleet):
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{fleet.url}/v1/completions", json=completion_body([1, 2], 3),
                                 headers=fleet.headers) as response:
            assert "x-flotilla-stream-id" not in response.headers
            result = StreamResult()
            await read_events(response, result)
    assert result.done and result.event_ids == []
