"""One rescale of one pool: router signals -> control law -> router states and the Deployment's replicas.

Kubernetes cannot declare a pod warm before it starts (its name is not known yet), so new pods register in
rotation and this step settles the router to the decision: surplus active workers are demoted to warm
while the warm pool is short, and drained otherwise (least busy first); a scale-up takes back draining
workers before it starts pods. The scale-down path, never hurried:

1. the control law decides it after the pool's long scale-down cooldown, one drain at a time;
2. the victims are set DRAINING in the router (no new work; their streams go on);
3. each is drained once it holds no stream, request or KV hand-off (flotilla.autoscaling.drain), by a load
   report sent after its drain began; until then the replicas still count it (every draining worker of the
   pool in the router counts, whoever set it draining);
4. its pod gets the lowest `controller.kubernetes.io/pod-deletion-cost`, so the ReplicaSet removes exactly
   it, and only then are the replicas lowered (not while a pod is starting: the ReplicaSet would remove the
   not-ready pod first, whatever its cost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.autoscaling.control import NEVER, Decision, ScalerState, decide
from flotilla.autoscaling.drain import drain_finished
from flotilla.autoscaling.router_client import RouterClient, token_mix
from flotilla.autoscaling.signals import PoolSignals
from flotilla.operator.pool_spec import ROLES, PoolSpec
from flotilla.operator.ratio import explain, prefill_floor, with_floor


@dataclass
class RescaleResult:
    replicas: int
    decision: Decision
    signals: PoolSignals
    draining: list[str]
    drained: list[str] = field(default_factory=list)  # idle now: their pods may go
    reactivated: list[str] = field(default_factory=list)  # taken back from draining: their pods stay

    def status(self, ready_replicas: int) -> dict[str, Any]:
        s = self.signals
        return {
            "desiredReplicas": self.replicas,
            "activeReplicas": self.decision.num_active,
            "warmReplicas": self.decision.num_warm,
            "readyReplicas": ready_replicas,
            "draining": self.draining,
            "signals": {
                "queuedRequests": s.num_queued_requests, "queuedTokens": s.num_queued_tokens,
                "kvUtilisation": round(s.kv_utilisation, 4), "ttftP95Seconds": round(s.ttft_p95_s, 4),
                "promptTokens": s.num_prompt_tokens, "outputTokens": s.num_output_tokens,
                "registeredActive": s.num_active, "registeredWarm": s.num_warm,
                "registeredDraining": s.num_draining,
            },
            "lastDecision": {"time": _iso(time.time()), "reason": self.decision.reason},
            "lastScaleUpTime": _epoch_or_none(self.decision.state.last_scale_up_s),
            "lastScaleDownTime": _epoch_or_none(self.decision.state.last_scale_down_s),
        }


def scaler_state(status: dict[str, Any]) -> ScalerState:
    up, down = status.get("lastScaleUpTime"), status.get("lastScaleDownTime")
    return ScalerState(NEVER if up is None else float(up), NEVER if down is None else float(down))


def rescale(spec: PoolSpec, status: dict[str, Any], router: RouterClient, current_replicas: int,
            now_s: float, num_decode: int | None = None) -> RescaleResult:
    """now_s: wall-clock seconds (the state lives in the status, across operator restarts).
    num_decode: a prefill pool's decode replicas of the same model (None: no decode pool, no ratio floor)."""
    role = ROLES[spec.role]
    workers = {w.worker.worker_id: w for w in router.workers(spec.model.name) if spec.owns(w.worker)}
    # Draining workers from the router, not from the status: kopf may hand a timer the body from before its
    # last status patch, and a victim missing from the count would lower the replicas under its streams.
    draining = sorted(w for w, worker in workers.items() if worker.state == rpb.WORKER_STATE_DRAINING)
    drained = [w for w in draining if drain_finished(workers[w])]
    # Pods not registered yet. A lower bound: a victim whose pod is going may still be registered.
    num_starting = max(0, current_replicas - len(workers))
    if num_starting:
        drained = []  # lowered now, the ReplicaSet would remove a starting (not ready) pod instead
    draining = [w for w in draining if w not in drained]
    signals = router.signals(spec.model.name, spec.signals_window_s, role, spec.pool)  # the pool's own
    floor = None
    if spec.role == "prefill" and num_decode is not None:
        floor = prefill_floor(spec.policy, num_decode, token_mix(signals), spec.throughput)
    decision = explain(decide(with_floor(spec.policy, floor), signals, scaler_state(status), now_s, num_starting),
                       floor)
    # A scale-up takes back draining workers (loaded, no cold start): those still busy first, then drained ones.
    newly_draining, reactivated = _settle(router, workers, decision, draining + drained)
    draining = [w for w in draining if w not in reactivated] + newly_draining
    drained = [w for w in drained if w not in reactivated]
    replicas = decision.num_active + decision.num_warm + len(draining)
    return RescaleResult(replicas, decision, signals, draining, drained, reactivated)


def _settle(router: RouterClient, workers: dict[str, rpb.WorkerStatus], decision: Decision,
            draining: list[str]) -> tuple[list[str], list[str]]:
    """Move router states toward the decision; returns (the workers newly set draining, the draining ones
    set back to active, in the order given: a scale-up takes them before it waits for new pods)."""
    active = _least_busy(workers, rpb.WORKER_STATE_ACTIVE)
    warm = _least_busy(workers, rpb.WORKER_STATE_WARM)
    promote = warm[: max(0, decision.num_active - len(active))]
    reactivate = draining[: max(0, decision.num_active - len(active) - len(promote))]
    for worker_id in promote + reactivate:
        router.set_state(worker_id, rpb.WORKER_STATE_ACTIVE)
    num_warm = len(warm) - len(promote)
    surplus = active[: max(0, len(active) - decision.num_active)]
    demote = surplus[: max(0, decision.num_warm - num_warm)]
    for worker_id in demote:
        router.set_state(worker_id, rpb.WORKER_STATE_WARM)
    to_drain = surplus[len(demote):] + warm[len(promote):][: max(0, num_warm - decision.num_warm)]
    for worker_id in to_drain:
        router.set_state(worker_id, rpb.WORKER_STATE_DRAINING)
    return to_drain, reactivate


def _least_busy(workers: dict[str, rpb.WorkerStatus], state: int) -> list[str]:
    chosen = sorted((w for w in workers.values() if w.state == state),
                    key=lambda w: (w.num_inflight, w.load.num_running + w.load.num_waiting, w.worker.worker_id))
    return [w.worker.worker_id for w in chosen]


def _epoch_or_none(value: float) -> float | None:
    return None if value == NEVER else round(value, 3)


def _iso(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))
