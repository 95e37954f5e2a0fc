"""`flotilla probe` (the chart's exec probes) against real gRPC servers: a WorkerService whose Health says ready
or not (as a worker whose golden-output check failed does), a RouterService that answers, and nothing at all."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.api.worker.v1 import worker_pb2, worker_pb2_grpc


class Worker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, ready: bool):
        self.ready = ready

    def Health(self, request, context):
        return worker_pb2.HealthResponse(ready=self.ready, worker_id="w-1")


class Router(router_pb2_grpc.RouterServiceServicer):
    def ListModels(self, request, context):
        return router_pb2.ListModelsResponse()


@pytest.fixture
def serve():
    servers = []

    def start(add, servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flotilla.cli", "probe", *args], capture_output=True, text=True,
                          timeout=60)


def test_ready_worker_passes(serve):
    address = serve(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Worker(ready=True))
    result = probe("worker", address)
    assert result.returncode == 0, result.stderr


def test_worker_not_ready_fails_and_says_so(serve):
    address = serve(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Worker(ready=False))
    result = probe("worker", address)
    assert result.returncode == 1
    assert "worker w-1 is not ready" in result.stderr


def test_router_answers(serve):
    address = serve(router_pb2_grpc.add_RouterServiceServicer_to_server, Router())
    assert probe("router", address).returncode == 0


def test_nothing_listening_fails(serve):
    address = serve(router_pb2_grpc.add_RouterServiceServicer_to_server, Router())
    result = probe("worker", address)  # a router there: Health is UNIMPLEMENTED
    assert result.returncode == 1 and "UNIMPLEMENTED" in result.stderr
    result = probe("router", "127.0.0.1:1", "--timeout-s", "1")
    assert result.returncode == 1 and "unreachable: UNAVAILABLE" in result.stderr
