"""The local supervisor's bookkeeping with a scripted router: which workers it promotes, drains and stops.
(The real router and worker processes are in test_local_burst.py.)"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.autoscaling.policy import PoolPolicy
from flotilla.autoscaling.signals import PoolSignals
from flotilla.autoscaler.supervisor import LocalSupervisor, SupervisorConfig
from flotilla.observability.autoscaler import AutoscalerMetrics


class ScriptedRouter:
    """Holds worker states like the router does; load figures are set by the test."""

    def __init__(self) -> None:
        self.statuses: dict[str, rpb.WorkerStatus] = {}
        self.pending: dict[str, int] = {}
        self.queued_tokens = 0

    def add(self, worker_id: str, state: int) -> None:
        info = rpb.WorkerInfo(worker_id=worker_id, model=pb.ModelInfo(name="m", version="v"))
        self.statuses[worker_id] = rpb.WorkerStatus(worker=info, healthy=True, state=state)

    def workers(self, model: str) -> list[rpb.WorkerStatus]:
        return list(self.statuses.values())

    def signals(self, model: str, window_s: float) -> PoolSignals:
        states = [s.state for s in self.statuses.values()]
        return PoolSignals(num_active=states.count(rpb.WORKER_STATE_ACTIVE),
                           num_warm=states.count(rpb.WORKER_STATE_WARM),
                           num_draining=states.count(rpb.WORKER_STATE_DRAINING),
                           num_queued_tokens=self.queued_tokens)

    def set_state(self, worker_id: str, state: int) -> None:
        if worker_id in self.statuses:
            self.statuses[worker_id].state = state
        else:
            self.pending[worker_id] = state

    def close(self) -> None:
        pass


class Launcher:
    def __init__(self) -> None:
        self.next = 10
        self.running: set[str] = set()
        self.stopped: list[str] = []

    def next_replica_id(self) -> str:
        return f"w{self.next}"

    def start_replica(self, replica_id: str) -> None:
        self.running.add(replica_id)
        self.next += 1

    def stop_replica(self, replica_id: str) -> None:
        self.running.discard(replica_id)
        self.stopped.append(replica_id)

    def is_running(self, replica_id: str) -> bool:
        return replica_id in self.running


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(policy: PoolPolicy):
    router, launcher, clock = ScriptedRouter(), Launcher(), Clock()
    supervisor = LocalSupervisor(SupervisorConfig("m", policy, drain_settle_s=0.5), router, launcher, clock)
    return supervisor, router, launcher, clock


POLICY = PoolPolicy(min_replicas=1, max_replicas=3, warm_replicas=1, target_queued_tokens_per_replica=100,
                    scale_down_cooldown_s=10.0)


def test_new_workers_are_declared_warm_before_they_start_and_not_started_twice():
    supervisor, router, launcher, _ = make(POLICY)
    router.add("w1", rpb.WORKER_STATE_ACTIVE)
    supervisor.tick()
    assert router.pending == {"w10": rpb.WORKER_STATE_WARM} and launcher.running == {"w10"}
    supervisor.tick()  # still loading: not started again
    assert launcher.running == {"w10"}
    router.add("w10", router.pending.pop("w10"))
    router.queued_tokens = 250  # burst: 3 replicas wanted
    supervisor.tick()
    assert router.statuses["w10"].state == rpb.WORKER_STATE_ACTIVE  # promoted first
    assert launcher.running == {"w10", "w11", "w12"}  # one more active-to-be and the warm refill


def test_drained_worker_stops_only_after_its_streams_finish():
    supervisor, router, launcher, clock = make(POLICY)
    for worker_id in ("w1", "w2"):
        router.add(worker_id, rpb.WORKER_STATE_ACTIVE)
    router.add("w3", rpb.WORKER_STATE_WARM)
    router.statuses["w1"].num_inflight = 1  # busier: w2 is the one to drain
    supervisor.tick()
    assert router.statuses["w2"].state == rpb.WORKER_STATE_DRAINING
    router.statuses["w2"].num_inflight = 2  # streams placed before the drain still run
    router.statuses["w2"].load.num_running = 2
    for _ in range(5):
        clock.now += 1.0
        supervisor.tick()
    assert launcher.stopped == []
    router.statuses["w2"].num_inflight = 0
    router.statuses["w2"].load.num_running = 0
    supervisor.tick()  # idle seen once: wait drain_settle_s in case a placement is on its way
    assert launcher.stopped == []
    clock.now += 0.5
    supervisor.tick()
    assert launcher.stopped == ["w2"]
    assert router.statuses["w1"].state == rpb.WORKER_STATE_ACTIVE


def _gauge(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"pool": "m", "model": "m", "role": "both"})


def test_each_tick_sets_desired_and_actual_replica_gauges():
    supervisor, router, _, _ = make(POLICY)
    registry = CollectorRegistry()
    supervisor.metrics = AutoscalerMetrics.create(registry)
    router.add("w1", rpb.WORKER_STATE_ACTIVE)
    router.queued_tokens = 250  # 3 active wanted, plus the warm one
    supervisor.tick()
    assert _gauge(registry, "flotilla_autoscaler_desired_replicas") == 4
    assert _gauge(registry, "flotilla_autoscaler_actual_replicas") == 1
    assert (_gauge(registry, "flotilla_autoscaler_active_replicas"), _gauge(registry, "flotilla_autoscaler_warm_replicas")) == (1, 0)
    for worker_id in sorted(router.pending):  # the started workers register (warm) and get promoted
        router.add(worker_id, router.pending.pop(worker_id))
    supervisor.tick()
    assert _gauge(registry, "flotilla_autoscaler_actual_replicas") == 4
    assert _gauge(registry, "flotilla_autoscaler_warm_replicas") == 3  # what the router reported this tick
