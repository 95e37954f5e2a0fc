"""Cold start from zero with the local supervisor (the autoscaler's control law against worker processes): a
request for a known model with no replica waits while the supervisor starts one and succeeds; a model whose
workers cannot load answers MODEL_STARTING (the gateway's 503 "model is starting" with Retry-After) once the
bound passes; an idle model scales back to zero."""

from __future__ import annotations

import itertools
import time

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.autoscaler.supervisor import LocalSupervisor, SupervisorConfig
from flotilla.autoscaling.policy import PoolPolicy
from flotilla.autoscaling.router_client import RouterClient
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.rpc.convert import new_request_to_proto

from tests.support.fleet import NO_OUTPUT_CHECK, start_service
from tests.support.tls import channel, client_tls
from tests.support.waiting import wait_until

# From zero, back to zero once idle for 2 s.
POLICY = PoolPolicy(min_replicas=0, max_replicas=1, warm_replicas=0, scale_down_cooldown_s=2.0, ttft_p95_slo_s=60)


class WorkerLauncher:
    """The supervisor's ReplicaLauncher: `flotilla worker` processes serving one checkpoint directory."""

    def __init__(self, state_dir, router_address: str, model: str, model_dir: str):
        self._state_dir, self._router, self._model, self._model_dir = state_dir, router_address, model, model_dir
        self._ids = (f"{model}-{i}" for i in itertools.count())
        self._next = next(self._ids)
        self.processes = {}

    def next_replica_id(self) -> str:
        return self._next

    def start_replica(self, replica_id: str) -> None:
        self._next = next(self._ids)
        self.processes[replica_id] = start_service(
            self._state_dir, replica_id, "worker", *NO_OUTPUT_CHECK, "--router", self._router, "--model-dir",
            self._model_dir, "--model-name", self._model, "--worker-id", replica_id, "--device", "cpu",
            "--num-kv-blocks", "64", wait=False)

    def stop_replica(self, replica_id: str) -> None:
        self.processes[replica_id].stop(timeout_s=10.0)

    def is_running(self, replica_id: str) -> bool:
        return replica_id in self.processes and self.processes[replica_id].is_running()

    def stop_all(self) -> None:
        for process in self.processes.values():
            process.stop(timeout_s=10.0)


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("cold-start")
    router = start_service(state_dir, "router", "router", "--model", "tiny", "--model", "broken",
                           "--cold-start-wait-s", "90", "--heartbeat-timeout-s", "1.0")
    launchers, supervisors = [], []
    try:
        for model, model_dir in (("tiny", str(tiny_checkpoint)), ("broken", str(state_dir / "no-such-checkpoint"))):
            launcher = WorkerLauncher(state_dir, router.address, model, model_dir)
            supervisor = LocalSupervisor(SupervisorConfig(model, POLICY, interval_s=0.1),
                                         RouterClient(router.address, client_tls("operator")),
                                         launcher)
            supervisor.start()
            launchers.append(launcher)
            supervisors.append(supervisor)
        yield router.address, supervisors[0]
    finally:
        for supervisor in supervisors:
            supervisor.stop()
        for launcher in launchers:
            launcher.stop_all()
        router.stop(timeout_s=10.0)


def generate(stub, model: str, deadline_unix_s: float = 0.0) -> tuple[float | None, list[pb.GenerateResponse]]:
    """(seconds to the first token or None, every event) of one greedy request."""
    request = new_request_to_proto(NewRequest(f"cold-{model}-{time.monotonic()}", (1, 2, 3),
                                              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                              deadline_unix_s=deadline_unix_s), model)
    started, ttft, events = time.monotonic(), None, []
    for event in stub.Generate(request, timeout=120):
        if ttft is None and event.HasField("chunk"):
            ttft = time.monotonic() - started
        events.append(event)
    return ttft, events


def workers_of(stub, model: str) -> list[rpb.WorkerStatus]:
    return [w for w in stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5).workers if w.worker.model.name == model]


def test_cold_start_from_zero_then_idle_scale_to_zero(fleet):
    address, supervisor = fleet
    stub = router_pb2_grpc.RouterServiceStub(channel(address))
    assert workers_of(stub, "tiny") == []
    ttft, events = generate(stub, "tiny")
    assert events[-1].HasField("finished") and events[-1].finished.usage.completion_tokens == 4, events[-1]
    print(f"\ncold start from zero: first token after {ttft:.1f} s")
    assert any(e.started for e in supervisor.events) and any(e.promoted for e in supervisor.events)
    # Warm now: the next request starts at once, on the same replica.
    _, again = generate(stub, "tiny")
    assert again[-1].HasField("finished") and again[-1].worker_id == events[-1].worker_id
    # Idle past the cooldown: drained and stopped, back to zero.
    wait_until(lambda: workers_of(stub, "tiny") == [], 60, "the idle model to scale to zero")
    assert any(e.drained for e in supervisor.events)


def test_a_model_that_cannot_load_says_it_is_starting_with_a_retry_after(fleet):
    address, _ = fleet
    stub = router_pb2_grpc.RouterServiceStub(channel(address))
    _, events = generate(stub, "broken", deadline_unix_s=time.time() + 3.0)
    (event,) = events
    assert event.error.code == pb.ERROR_CODE_MODEL_STARTING and event.error.retry_after_s > 0
    assert "model 'broken' is starting" in event.error.message
