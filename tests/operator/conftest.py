"""A real router process, fake workers that register and heartbeat over real gRPC, and the kmock Kubernetes
emulator with the resources the operator touches declared (kmock knows only what it is told)."""

from __future__ import annotations

import threading

import grpc
import kmock
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.fleet.process import ServiceProcess

from tests.support.fleet import start_service
from tests.support.tls import channel

MODEL = "tiny"
POOL_RESOURCE = "flotilla.dev/v1alpha1/flotillapools"
ROUTE_RESOURCE = "flotilla.dev/v1alpha1/flotillamodelroutes"  # the operator watches it too


class FakeWorkers:
    """Workers as the router sees them: registration and load reports, no engine behind them. They speak with
    a worker certificate; ListWorkers (states) goes as an operator, the only role allowed to list them."""

    def __init__(self, router_address: str):
        self._channel = channel(router_address, client_role="worker")
        self.stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._operator_channel = channel(router_address)
        self.operator = router_pb2_grpc.RouterServiceStub(self._operator_channel)
        self.loads: dict[str, pb.LoadReport] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def add(self, worker_id: str, queued_tokens: int = 0, role: int = pb.WORKER_ROLE_DECODE, pool: str = "") -> None:
        info = rpb.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9", role=role, pool=pool,
                              model=pb.ModelInfo(name=MODEL, version="v1", max_model_len=2048))
        self.stub.RegisterWorker(rpb.RegisterWorkerRequest(worker=info), timeout=5)
        self.set_load(worker_id, queued_tokens)

    def set_load(self, worker_id: str, queued_tokens: int) -> None:
        load = pb.LoadReport(num_queued_tokens=queued_tokens, num_free_blocks=100, num_total_blocks=100,
                             block_size=16)
        with self._lock:
            self.loads[worker_id] = load
        self.stub.Heartbeat(rpb.HeartbeatRequest(worker_id=worker_id, load=load), timeout=5)

    def states(self) -> dict[str, int]:
        response = self.operator.ListWorkers(rpb.ListWorkersRequest(), timeout=5)
        return {w.worker.worker_id: w.state for w in response.workers}

    def _beat(self) -> None:
        while not self._stop.wait(0.2):  # heartbeat period, as a worker does
            with self._lock:
                loads = dict(self.loads)
            for worker_id, load in loads.items():
                try:
                    self.stub.Heartbeat(rpb.HeartbeatRequest(worker_id=worker_id, load=load), timeout=5)
                except grpc.RpcError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()
        self._operator_channel.close()


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> ServiceProcess:
    process = start_service(tmp_path_factory.mktemp("router"), "router", "router", "--model", MODEL)
    yield process
    process.stop()


@pytest.fixture()
def workers(router: ServiceProcess) -> FakeWorkers:
    fake = FakeWorkers(router.address)
    yield fake
    for worker_id in list(fake.loads):
        fake.stub.DeregisterWorker(rpb.DeregisterWorkerRequest(worker_id=worker_id), timeout=5)
    fake.close()


@pytest.fixture()
def kube(kmock: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    kmock.resources["v1/namespaces"] = kmock_info("Namespace", namespaced=False)
    kmock.resources["v1/events"] = kmock_info("Event")
    kmock.resources["v1/pods"] = kmock_info("Pod")
    kmock.resources["v1/services"] = kmock_info("Service")
    kmock.resources["apps/v1/deployments"] = kmock_info("Deployment", subresources={"status", "scale"})
    kmock.resources[POOL_RESOURCE] = kmock_info("FlotillaPool", subresources={"status"})
    kmock.resources[ROUTE_RESOURCE] = kmock_info("FlotillaModelRoute", subresources={"status"})
    kmock.objects["v1/namespaces", None, "ns1"] = {"metadata": {"name": "ns1"}}
    return kmock


def kmock_info(kind: str, namespaced: bool = True, subresources: set[str] = frozenset()) -> kmock.ResourceInfo:
    verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
    return kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=verbs, subresources=set(subresources))
