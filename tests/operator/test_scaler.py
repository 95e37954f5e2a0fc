"""One rescale, pure: a stand-in for the router's answers (ListWorkers, GetPoolSignals, SetWorkerState) and
exact replicas. The scale-down path: a victim counts until its drain finished by a load report sent after the
drain began, every draining worker of the pool counts (not only those the status lists), replicas are not
lowered while a pod starts, and a scale-up takes a draining worker back before it asks for a new pod."""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.autoscaling.drain import drain_finished, holds_work
from flotilla.autoscaling.router_client import to_pool_signals
from flotilla.operator.pool_spec import parse_spec
from flotilla.operator.scaler import rescale

SPEC = parse_spec({
    "model": {"name": "tiny", "checkpoint": "/models/tiny"}, "role": "both",
    "replicas": {"min": 1, "max": 4, "warm": 0},
    "scaling": {"scaleDownCooldownSeconds": 0, "scaleToZeroAfterIdleSeconds": 0},
    "worker": {"image": "ghcr.io/flotilla/worker:0.1.0"},
})


def worker(worker_id: str, state: int = rpb.WORKER_STATE_ACTIVE, inflight: int = 0, running: int = 0,
           handoffs: int = 0, heartbeat_age_s: float = 0.1, in_state_s: float = 5.0) -> rpb.WorkerStatus:
    info = rpb.WorkerInfo(worker_id=worker_id, role=pb.WORKER_ROLE_BOTH, model=pb.ModelInfo(name="tiny"))
    load = pb.LoadReport(num_running=running, num_kv_handoffs=handoffs, num_free_blocks=100, num_total_blocks=100)
    return rpb.WorkerStatus(worker=info, healthy=True, load=load, state=state, num_inflight=inflight,
                            seconds_since_heartbeat=heartbeat_age_s, seconds_in_state=in_state_s)


class StandInRouter:
    def __init__(self, workers: list[rpb.WorkerStatus], queued_tokens: int = 0):
        self._workers = workers
        self._queued_tokens = queued_tokens
        self.states: dict[str, int] = {}

    def workers(self, model: str) -> list[rpb.WorkerStatus]:
        return self._workers

    def signals(self, model: str, window_s: float, role: int, pool: str = ""):
        by_state = [w.state for w in self._workers]
        return to_pool_signals(rpb.GetPoolSignalsResponse(
            num_active=by_state.count(rpb.WORKER_STATE_ACTIVE), num_warm=by_state.count(rpb.WORKER_STATE_WARM),
            num_draining=by_state.count(rpb.WORKER_STATE_DRAINING), num_queued_tokens=self._queued_tokens,
            num_total_blocks=100 * by_state.count(rpb.WORKER_STATE_ACTIVE)))

    def set_state(self, worker_id: str, state: int) -> None:
        self.states[worker_id] = state


DRAINING = rpb.WORKER_STATE_DRAINING


def test_a_drain_finishes_only_on_an_idle_report_sent_after_it_began():
    assert drain_finished(worker("w", DRAINING))
    assert not drain_finished(worker("w", DRAINING, heartbeat_age_s=0.3, in_state_s=0.2))  # report predates it
    for busy in (worker("w", DRAINING, inflight=1), worker("w", DRAINING, running=1),
                 worker("w", DRAINING, handoffs=1)):
        assert holds_work(busy) and not drain_finished(busy)
    assert not drain_finished(worker("w"))  # not draining at all


def test_victims_count_until_drained_and_are_then_the_pods_to_remove():
    # Two victims: one still streaming, one done; a worker set draining by hand counts too.
    router = StandInRouter([worker("a"), worker("b", DRAINING, inflight=2), worker("c", DRAINING),
                            worker("d", DRAINING, running=1)])
    result = rescale(SPEC, {"draining": ["b", "c"]}, router, current_replicas=4, now_s=1000.0)
    assert result.drained == ["c"]
    assert result.draining == ["b", "d"]
    assert result.replicas == 3  # a, and the two still draining
    assert router.states == {}  # one drain at a time: no new victim while b and d drain


def test_a_drained_pod_is_not_released_while_another_pod_starts():
    # The ReplicaSet would remove the starting pod (not ready) instead of the victim, whatever its cost.
    router = StandInRouter([worker("a"), worker("c", DRAINING)])
    result = rescale(SPEC, {}, router, current_replicas=3, now_s=1000.0)  # the third pod has not registered
    assert result.drained == [] and result.draining == ["c"]
    assert result.replicas == result.decision.num_active + 1  # c still counted
    released = rescale(SPEC, {}, router, current_replicas=2, now_s=1000.0)  # it registered, or went
    assert released.drained == ["c"] and released.replicas == 1


def test_a_scale_up_takes_draining_workers_back_before_a_new_pod():
    router = StandInRouter([worker("a"), worker("b", DRAINING, inflight=1)], queued_tokens=3000)
    result = rescale(SPEC, {}, router, current_replicas=2, now_s=1000.0)
    assert router.states == {"b": rpb.WORKER_STATE_ACTIVE} and result.reactivated == ["b"]
    assert result.draining == [] and result.replicas == 2  # 2 active wanted: a and b, no new pod
    # A drained one too (its pod's deletion cost is cleared by the handler), after the busy ones.
    router = StandInRouter([worker("a"), worker("b", DRAINING, inflight=1), worker("c", DRAINING)],
                           queued_tokens=5000)
    result = rescale(SPEC, {}, router, current_replicas=3, now_s=1000.0)
    assert result.reactivated == ["b", "c"] and result.drained == [] and result.replicas == 3
