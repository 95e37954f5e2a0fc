"""Internal gRPC as an attacker inside the cluster would try it, against the real (mTLS) fleet: a fake worker
registering a "newer" version of the served model with a non-worker certificate, a worker identity taking a
registered worker's id over, clients with no or a foreign certificate, callers listing workers or steering
them without the role for it. Every one is refused; the request that follows is served by the real worker and
the fake worker's server never hears from the router."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import httpx
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.rpc.certs import CertificateAuthority
from flotilla.rpc.options import sync_channel
from flotilla.rpc.tls import InternalTLS, server_name

from tests.support.tls import client_tls, session_ca


class Eavesdropper(grpc.GenericRpcHandler):
    """A worker's gRPC server that records every call anyone makes to it, whatever the method."""

    def __init__(self):
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def service(self, handler_call_details):
        with self._lock:
            self.calls.append(handler_call_details.method)
        return None  # UNIMPLEMENTED: it has nothing to serve


@pytest.fixture()
def fake_worker():
    """A TLS server with a real worker certificate (the best an attacker could hold), recording calls."""
    tls = client_tls("worker", "impostor")
    recorder = Eavesdropper()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[recorder])
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    yield f"127.0.0.1:{port}", recorder
    server.stop(0)


def _fake_info(worker_id: str, address: str, fleet) -> rpb.WorkerInfo:
    real = next(iter(fleet.router_workers().values())).worker.model
    model = pb.ModelInfo(name=fleet.model, version="v999-newer", max_model_len=real.max_model_len,
                         assets_digest=real.assets_digest)
    return rpb.WorkerInfo(worker_id=worker_id, address=address, role=pb.WORKER_ROLE_BOTH, model=model)


def _router(fleet, role: str, name: str = "attacker") -> router_pb2_grpc.RouterServiceStub:
    """The router, called with a certificate from the fleet's CA for identity `role`/`name`."""
    return router_pb2_grpc.RouterServiceStub(sync_channel(fleet.fleet.router_address, client_tls(role, name), "router"))


def _denied(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    return err.value


def test_fake_worker_and_id_takeover_are_refused_and_the_real_worker_serves(fleet, fake_worker):
    address, recorder = fake_worker
    real_id = next(iter(fleet.router_workers()))
    before = fleet.worker_load().num_prompt_tokens_total

    # A certificate of another role cannot register at all, even for an id nobody holds.
    for role in ("gateway", "operator", "router"):
        error = _denied(_router(fleet, role).RegisterWorker,
                        rpb.RegisterWorkerRequest(worker=_fake_info("fresh-id", address, fleet)))
        assert f"{role} identities may not call RegisterWorker" in error.details()
    # A worker identity cannot take over, speak for, or remove a worker id another identity registered.
    impostor = _router(fleet, "worker", "impostor")
    error = _denied(impostor.RegisterWorker, rpb.RegisterWorkerRequest(worker=_fake_info(real_id, address, fleet)))
    assert "registered by another identity" in error.details()
    _denied(impostor.Heartbeat, rpb.HeartbeatRequest(worker_id=real_id, load=pb.LoadReport(num_total_blocks=1)))
    _denied(impostor.DeregisterWorker, rpb.DeregisterWorkerRequest(worker_id=real_id))

    workers = fleet.router_workers()
    assert list(workers) == [real_id] and workers[real_id].healthy
    assert workers[real_id].worker.model.version != "v999-newer"
    response = httpx.post(f"{fleet.url}/v1/completions", headers=fleet.headers, timeout=60,
                          json={"model": fleet.model, "prompt": "who sees this prompt?", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert fleet.worker_load().num_prompt_tokens_total > before  # the real worker ran it
    assert recorder.calls == []  # the fake worker never heard from the router


def test_clients_without_a_certificate_from_the_fleet_ca_are_refused_at_the_handshake(fleet):
    address = fleet.fleet.router_address
    foreign_ca = CertificateAuthority.create("someone else's CA")
    cert, key = foreign_ca.issue("operator", "outsider")
    channels = {
        "plaintext": grpc.insecure_channel(address),
        "no client certificate": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(session_ca().cert_pem),
            options=[("grpc.ssl_target_name_override", server_name("router"))]),
        "certificate of another CA": sync_channel(address, InternalTLS(session_ca().cert_pem, cert, key), "router"),
    }
    for what, refused in channels.items():
        with refused, pytest.raises(grpc.RpcError) as err:
            router_pb2_grpc.RouterServiceStub(refused).ListModels(rpb.ListModelsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what


def test_only_the_operator_lists_and_steers_workers_and_the_list_names_no_requests(fleet):
    real_id = next(iter(fleet.router_workers()))
    for role in ("gateway", "worker"):
        stub = _router(fleet, role)
        _denied(stub.ListWorkers, rpb.ListWorkersRequest())
        _denied(stub.SetWorkerState, rpb.SetWorkerStateRequest(worker_id=real_id, state=rpb.WORKER_STATE_DRAINING))
        _denied(stub.GetPoolSignals, rpb.GetPoolSignalsRequest(model=fleet.model))
    _denied(_router(fleet, "worker").ListModels, rpb.ListModelsRequest())
    # Prompts have gone through this worker (its prefix cache holds their blocks): none of it is listed.
    httpx.post(f"{fleet.url}/v1/completions", headers=fleet.headers, timeout=60,
               json={"model": fleet.model, "prompt": "a prompt long enough to fill a block or two " * 4,
                     "max_tokens": 2})
    status = fleet.router_workers()[real_id]
    assert status.state == rpb.WORKER_STATE_ACTIVE
    assert not status.load.active_request_ids and not status.load.cached_block_hashes
