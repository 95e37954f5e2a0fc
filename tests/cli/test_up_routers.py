"""Two routers through `flotilla up --routers 2`, as a user runs it: kill -9 of the router that owns the model
under 64 streams. Every stream completes with the text of an undisturbed run (those on the dead router,
queued or streaming, are submitted again by the gateway to the other router with what they had received);
a new request is served right after the kill; the launcher restarts the router, the workers register with it
again, and the model's traffic goes back to its owner. A route change (`flotilla models alias`) is made on both
routers, and the alias's requests go to the model's owner."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.cli import main
from flotilla.fleet.certs import FleetCerts
from flotilla.rpc.options import sync_channel
from flotilla.rpc.router_ownership import owner_order
from flotilla.usage.record import STATUS_OPEN
from flotilla.usage.sinks import read_file

from tests.support.fleet import MODEL, metric_samples
from tests.support.waiting import wait_until

from .flotilla_up import API_KEY, FlotillaUp, openai_client, start_flotilla_up
from .flotilla_up import chat_stream as shared_chat_stream

NUM_STREAMS = 64
MAX_TOKENS = 16
PROMPTS = [f"Route number {i} of the fleet." for i in range(NUM_STREAMS)]
ROUTERS = ("router-0", "router-1")


@pytest.fixture(scope="module")
def up(tiny_checkpoint, tmp_path_factory):
    up = start_flotilla_up(tiny_checkpoint, tmp_path_factory.mktemp("routers") / "state", "--workers", "2",
                           "--routers", "2", model_name=MODEL, worker_args=["--num-kv-blocks", "512"],
                           gateway_args=["--max-streams-per-key", "128"])  # 64 streams and a new one
    yield up
    up.stop()


async def chat_stream(oai: openai.AsyncOpenAI, prompt: str, on_chunk=None) -> str:
    return await shared_chat_stream(oai, MODEL, prompt, MAX_TOKENS, on_chunk)


def owner(up: FlotillaUp) -> tuple[str, str]:
    """(owner, the other): the router the gateway sends MODEL to while both are up."""
    by_address = {up.address_of(name): name for name in ROUTERS}
    first, second = owner_order(list(by_address), MODEL)
    return by_address[first], by_address[second]


def relayed_requests(up: FlotillaUp, router: str) -> float:
    """Requests the router has placed (its /metrics)."""
    port = (up.state_dir / "ports" / f"{router}.metrics.port").read_text().strip()
    return sum(s.value for s in metric_samples(f"127.0.0.1:{port}")
               if s.name == "flotilla_router_requests_total")


def final_records(up: FlotillaUp, count: int):
    path = up.state_dir / "usage.jsonl"
    return wait_until(lambda: len(records := [r for r in read_file(path) if r.status != STATUS_OPEN]) >= count
                      and records, 30, f"{count} usage records", interval_s=0.05)


def test_workers_register_with_both_routers_and_the_owner_serves_the_model(up):
    for router in ROUTERS:
        wait_until(lambda: sum(w.healthy for w in up.router_workers(router).values()) == 2, 30,
                   f"both workers registered with {router}")
    owning, other = owner(up)
    before = relayed_requests(up, owning), relayed_requests(up, other)

    async def one() -> str:
        async with openai_client(up) as oai:
            return await chat_stream(oai, PROMPTS[0])

    assert asyncio.run(one())
    wait_until(lambda: relayed_requests(up, owning) == before[0] + 1, 5, f"{owning} to count the request")
    assert relayed_requests(up, other) == before[1]


def test_a_route_change_reaches_every_router_and_an_alias_shares_its_models_router(up, capsys):
    assert main(["models", "--state-dir", str(up.state_dir), "alias", "chat", MODEL]) == 0
    tls = FleetCerts(up.state_dir).client("operator", "routes-test")
    for router in ROUTERS:
        address = up.address_of(router)
        with sync_channel(address, tls, "router") as channel:
            routes = router_pb2_grpc.RouterServiceStub(channel).ListModelRoutes(rpb.ListModelRoutesRequest(), timeout=5)
        assert {(a.alias, a.target) for a in routes.aliases} == {("chat", MODEL)}, router
    owning, other = owner(up)
    before = relayed_requests(up, owning), relayed_requests(up, other)

    def gateway_knows_alias() -> bool:  # the gateway learns new names on its next model-list refresh
        models = openai.OpenAI(base_url=f"{up.url}/v1", api_key=API_KEY, max_retries=0).models.list()
        return any("chat" in (getattr(m, "aliases", None) or ()) for m in models)

    wait_until(gateway_knows_alias, 10, "the gateway to list the alias")

    async def one() -> str:
        async with openai_client(up) as oai:
            stream = await oai.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4, temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(one())
    wait_until(lambda: relayed_requests(up, owning) == before[0] + 1, 5, f"{owning} to count the request")
    assert relayed_requests(up, other) == before[1]  # the alias's requests queue with the model's


def test_kill_9_of_the_owning_router_under_64_streams_every_stream_completes(up):
    async def all_streams(on_chunk=None) -> list[str]:
        async with openai_client(up) as oai:
            return await asyncio.gather(*(chat_stream(oai, prompt, on_chunk) for prompt in PROMPTS))

    reference = asyncio.run(all_streams())
    num_before = len(final_records(up, NUM_STREAMS + 1))
    owning, other = owner(up)
    placed_by_other_before = relayed_requests(up, other)
    killed_at: list[float] = []

    def kill_once(num_chunks: int) -> None:
        if not killed_at:
            up.kill(owning)
            killed_at.append(time.monotonic())

    async def disturbed() -> tuple[list[str], float]:
        streams = asyncio.ensure_future(all_streams(kill_once))
        while not killed_at:
            await asyncio.sleep(0.005)  # polling for the kill, which the first streamed token triggers
        first_token_at: list[float] = []
        async with openai_client(up) as oai:  # a new request, sent the moment the owner is gone
            await chat_stream(oai, PROMPTS[0], lambda num_chunks: first_token_at.append(time.monotonic()))
        return await streams, first_token_at[0] - killed_at[0]

    texts, new_request_s = asyncio.run(disturbed())
    assert texts == reference  # no stream failed, none differs from the undisturbed run
    records = final_records(up, num_before + NUM_STREAMS + 1)[num_before:]
    resumed = sum(r.attempts >= 2 for r in records)
    print(f"\n{resumed} requests were resumed on the other router; a new one sent at the kill had its first token "
          f"{new_request_s * 1000:.0f} ms after it")
    assert all(r.status == "ok" for r in records)
    # The owner placed at least the stream whose first token set off the kill; on the lease path those it placed
    # stream from the workers and its death cuts none, on the relay path they are resumed. The other router placed
    # the new request, the resumed streams, and those the owner had not placed yet when it died: still queued
    # there, or not yet arrived (on a loaded machine the first token can come before the last of the 64 requests
    # reached the gateway: CI once saw 42), which the gateway acquires again from it (FailoverAcquire).
    placed_by_other = relayed_requests(up, other) - placed_by_other_before
    print(f"the other router placed {placed_by_other:.0f} requests")
    assert 1 <= placed_by_other <= NUM_STREAMS + resumed, (placed_by_other, resumed)
    # Admitted, placed and streaming: the target is within 1 s of its router's death (0.6-0.8 s on this 2-core
    # machine with little else running, up to 1.8 s while other suites load it). The bound still fails a failover
    # that waits for a keepalive (15 s), a reconnect backoff or a queue timeout.
    assert new_request_s < 2.5

    up.wait_said(f"{owning} is serving again")
    wait_until(lambda: sum(w.healthy for w in up.router_workers(owning).values()) == 2, 30,
               f"both workers registered with the restarted {owning}", ignore=(Exception,))
    # The gateway's probe finds the owner again: the model's requests go back to it.
    wait_until(lambda: _served_by(up, owning), 30, f"a request served by the restarted {owning}")
    assert up.status()["services"][owning]["restarts"] == 1 and up.popen.poll() is None


def _served_by(up: FlotillaUp, router: str) -> bool:
    before = relayed_requests(up, router)

    async def one() -> str:
        async with openai_client(up) as oai:
            return await chat_stream(oai, PROMPTS[1])

    asyncio.run(one())
    try:
        return wait_until(lambda: relayed_requests(up, router) > before, 2, f"{router} to count the request")
    except AssertionError:
        return False
