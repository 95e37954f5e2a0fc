"""The autoscaler's router client over two real gRPC routers (a scripted RouterService each): a model's signals
come from the router that owns it (where its queue is), from the other when the owner is gone; a worker state is
set on both routers; the worker list comes from the first that answers."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.autoscaling.router_client import RouterClient
from flotilla.rpc.router_ownership import owner_order

MODEL = "m"


class ScriptedRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, queued: int):
        self.queued = queued  # tells the routers' signals apart
        self.states: list[tuple[str, int]] = []

    def GetPoolSignals(self, request, context):
        return rpb.GetPoolSignalsResponse(num_active=2, num_queued_requests=self.queued)

    def ListWorkers(self, request, context):
        return rpb.ListWorkersResponse(workers=[rpb.WorkerStatus(worker=rpb.WorkerInfo(
            worker_id="w1", model=pb.ModelInfo(name=MODEL, version="v1")))])

    def SetWorkerState(self, request, context):
        self.states.append((request.worker_id, request.state))
        return rpb.SetWorkerStateResponse(registered=True)


@pytest.fixture
def routers():
    started = {}
    for queued in (1, 2):
        fake = ScriptedRouter(queued)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started[f"127.0.0.1:{port}"] = (fake, server)
    yield started
    for _, server in started.values():
        server.stop(0)


def test_signals_from_the_owner_states_on_every_router(routers):
    owner, other = owner_order(list(routers), MODEL)
    client = RouterClient(",".join(routers))
    try:
        assert client.signals(MODEL, 10.0).num_queued_requests == routers[owner][0].queued
        assert [w.worker.worker_id for w in client.workers(MODEL)] == ["w1"]
        client.set_state("w1", rpb.WORKER_STATE_WARM)
        assert all(fake.states == [("w1", rpb.WORKER_STATE_WARM)] for fake, _ in routers.values())
        routers[owner][1].stop(0).wait()
        assert client.signals(MODEL, 10.0).num_queued_requests == routers[other][0].queued
        assert [w.worker.worker_id for w in client.workers(MODEL)] == ["w1"]
    finally:
        client.close()
