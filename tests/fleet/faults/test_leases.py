"""Placement leases with real processes: the router only places (a stream goes on while the router is
frozen), a gateway killed mid-stream leaves no lease held and no KV block used within the lease TTL, and a
worker serves only streams with a valid lease for it (forged, expired, another worker's or none: refused)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import httpx
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.rpc.leases import LeaseSigner, read_secret

from tests.support.fleet import MODEL, fleet_config, router_workers, start_fleet, worker_load
from tests.support.tls import channel
from tests.support.waiting import wait_until

from .sse_client import completion_body, stream_completion

LEASE_TTL_S = 5.0
NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def lease_fleet(tiny_checkpoint, tmp_path_factory):
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("leases"), num_workers=1, metrics=False,
                          worker_args=["--num-kv-blocks", str(NUM_KV_BLOCKS)],
                          router_args=["--lease-ttl-s", str(LEASE_TTL_S)])
    with start_fleet(config, keys={"k1": ("acme", "paid")}) as fleet:
        yield fleet


def _leases_held(fleet) -> int:
    return sum(status.num_inflight for status in router_workers(fleet.fleet.router_address).values())


def _idle(load: pb.LoadReport) -> bool:
    return not load.active_request_ids and load.num_free_blocks == load.num_total_blocks == NUM_KV_BLOCKS


def test_a_stream_goes_on_while_the_router_is_frozen(lease_fleet):
    """The router placed the stream and is off its path: SIGSTOP it mid-stream and the tokens keep coming."""
    router = lease_fleet.fleet.router.popen
    body = {**completion_body([5, 6, 7], 400), "ignore_eos": True}
    frozen = False

    async def freeze(result) -> None:
        nonlocal frozen
        if result.num_chunks >= 2 and not frozen:
            frozen = True
            router.send_signal(signal.SIGSTOP)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream_completion(client, lease_fleet.url, lease_fleet.headers, body, freeze)

    try:
        result = asyncio.run(run())
    finally:
        router.send_signal(signal.SIGCONT)
    assert frozen and result.error is None and result.done
    assert result.completion_tokens == 400 and result.finish_reason == "length"
    wait_until(lambda: _leases_held(lease_fleet) == 0, 10, "the lease released")


def test_a_gateway_killed_mid_stream_holds_no_lease_and_no_kv_block_after_the_lease_ttl(lease_fleet):
    gateway = lease_fleet.add_gateway()
    url = f"http://127.0.0.1:{gateway.port}"
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    num_streams = 6
    responses, clients = [], []
    for _ in range(num_streams):
        client = httpx.Client(timeout=30)
        clients.append(client)
        response = client.send(client.build_request("POST", f"{url}/v1/completions", json=body,
                                                    headers=lease_fleet.headers), stream=True)
        assert response.status_code == 200
        responses.append(response)
    lines = [response.iter_lines() for response in responses]
    for stream_lines in lines:  # every stream has tokens: placed, leased and running on the worker
        assert next(line for line in stream_lines if line.startswith("data: {"))
    assert _leases_held(lease_fleet) == num_streams
    assert len(worker_load(lease_fleet.fleet.workers[0]).active_request_ids) == num_streams
    gateway.kill()  # SIGKILL: nothing released on the way out
    killed = time.monotonic()
    wait_until(lambda: _leases_held(lease_fleet) == 0 and _idle(worker_load(lease_fleet.fleet.workers[0])),
               LEASE_TTL_S, "the leases released and the worker's blocks free", interval_s=0.05)
    print(f"\nleases and blocks free {time.monotonic() - killed:.2f} s after the gateway's SIGKILL")
    for response, client in zip(responses, clients):
        response.close()
        client.close()


def _generate(worker, request: pb.GenerateRequest, role: str = "gateway") -> list[pb.GenerateResponse]:
    with channel(worker.address, "worker", client_role=role) as worker_channel:
        stub = worker_pb2_grpc.WorkerServiceStub(worker_channel)
        return list(stub.Generate(request, timeout=30))


def test_the_worker_refuses_forged_expired_other_workers_and_missing_leases(lease_fleet):
    worker = lease_fleet.fleet.workers[0]
    secret = read_secret(os.path.join(lease_fleet.state_dir, "lease-secret"))
    model = next(iter(router_workers(lease_fleet.fleet.router_address).values())).worker.model
    qualified = f"{model.name}@{model.version}"

    def request(request_id: str, lease: pb.Lease | None) -> pb.GenerateRequest:
        msg = pb.GenerateRequest(request_id=request_id, model=qualified, prompt_token_ids=[5, 6, 7],
                                 sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
        if lease is not None:
            msg.lease.CopyFrom(lease)
        return msg

    def grant(request_id: str, worker_id: str = "worker-0", ttl_s: float = 30.0, key: bytes = secret) -> pb.Lease:
        return LeaseSigner(key, ttl_s).grant(request_id, worker_id, worker.address, qualified)

    accepted = _generate(worker, request("ok", grant("ok")))
    assert accepted[-1].HasField("finished") and sum(len(r.chunk.token_ids) for r in accepted) == 4
    forged = grant("forged", key=b"not-the-fleet-secret-but-as-long-as-one")
    for refused_request, why in [
        (request("none", None), "no placement lease"),
        (request("forged", forged), "does not match"),
        (request("other", grant("someone-else")), "does not match"),  # another request's lease
        (request("elsewhere", grant("elsewhere", worker_id="worker-9")), "worker-9"),
        (request("stale", grant("stale", ttl_s=-1.0)), "expired"),
    ]:
        (answer,) = _generate(worker, refused_request)
        assert answer.error.code == pb.ERROR_CODE_LEASE_REFUSED and why in answer.error.message, answer
    (answer,) = _generate(worker, request("router-none", None), role="router")  # the router needs one too
    assert answer.error.code == pb.ERROR_CODE_LEASE_REFUSED
    with pytest.raises(grpc.RpcError) as denied:  # an operator may not run requests at all
        _generate(worker, request("operator", grant("operator")), role="operator")
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _idle(worker_load(worker))


def _version_stats(fleet) -> rpb.VersionStats:
    with channel(fleet.fleet.router_address) as router:
        status = router_pb2_grpc.RouterServiceStub(router).GetModelStatus(rpb.GetModelStatusRequest(model=MODEL),
                                                                           timeout=5)
    (stats,) = status.versions
    return stats


def test_the_routers_per_version_stats_come_from_the_gateways_lease_reports(lease_fleet):
    before = _version_stats(lease_fleet)
    for _ in range(3):
        response = httpx.post(f"{lease_fleet.url}/v1/completions", headers=lease_fleet.headers, timeout=30,
                              json={"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 8, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert json.loads(response.text)["usage"]["completion_tokens"] == 8
    wait_until(lambda: _version_stats(lease_fleet).num_requests == before.num_requests + 3, 5, "3 lease reports")
    after = _version_stats(lease_fleet)
    assert after.error_rate == 0 and after.ttft_p50_s > 0 and after.tpot_p50_s > 0 and after.num_inflight == 0


def test_a_relaying_gateway_still_serves_through_the_router_which_signs_its_own_leases(lease_fleet):
    gateway = lease_fleet.add_gateway("--stream-path", "relay")
    response = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/completions", headers=lease_fleet.headers, timeout=30,
                          json={"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 6, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert json.loads(response.text)["usage"]["completion_tokens"] == 6
    gateway.stop()


def test_streams_in_flight_survive_a_router_killed_with_sigkill(lease_fleet):
    """Last in the module: it kills the fleet's router (and starts it again on its port for what follows)."""
    router = lease_fleet.fleet.router
    body = {**completion_body([7, 8, 9], 300), "ignore_eos": True}
    killed = False

    async def kill(result) -> None:
        nonlocal killed
        if result.num_chunks >= 2 and not killed:
            killed = True
            router.kill()

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(stream_completion(client, lease_fleet.url, lease_fleet.headers, body,
                                                            kill if i == 0 else None) for i in range(4)))

    try:
        results = asyncio.run(run())
    finally:
        router.start()  # the same port (keep_port): the workers register again
        router.wait_port(60)
    assert killed and [(r.error, r.completion_tokens) for r in results] == [(None, 300)] * 4
    wait_until(lambda: lease_fleet.num_healthy_workers() == 1, 30, "the worker registered again", interval_s=0.1)
