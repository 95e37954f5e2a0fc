"""One rescale of one pool: router signals -> control law -> router states and the Deployment's replicas.

Kubernetes cannot declare a pod warm before it starts (its name is not known yet), so new pods register in
rotation and this step settles the router to the decision: surplus active workers are demoted to warm
while the warm pool is short, and drained otherwise. A drained worker is stopped by lowering the replicas
once the router relays nothing from it, after its pod got the lowest deletion cost (the ReplicaSet removes
that pod first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.autoscaling.control import NEVER, Decision, ScalerState, decide
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
    workers = {w.worker.worker_id: w for w in router.workers(spec.model.name) if w.worker.role == role}
    draining = [w for w in status.get("draining", []) if w in workers]
    drained = [w for w in draining if _idle(workers[w])]
    draining = [w for w in draining if w not in drained]
    signals = router.signals(spec.model.name, spec.signals_window_s, role)
    num_starting = max(0, current_replicas - len(workers) - len(drained))
    floor = None
    if spec.role == "prefill" and num_decode is not None:
        floor = prefill_floor(spec.policy, num_decode, token_mix(signals), spec.throughput)
    decision = explain(decide(with_floor(spec.policy, floor), signals, scaler_state(status), now_s, num_starting),
                       floor)
    draining += _settle(router, workers, decision)
    replicas = decision.num_active + decision.num_warm + len(draining)
    return RescaleResult(replicas, decision, signals, draining, drained)


def _settle(router: RouterClient, workers: dict[str, rpb.WorkerStatus], decision: Decision) -> list[str]:
    """Move router states toward the decision; returns the workers newly set draining."""
    active = _least_busy(workers, rpb.WORKER_STATE_ACTIVE)
    warm = _least_busy(workers, rpb.WORKER_STATE_WARM)
    promote = warm[: max(0, decision.num_active - len(active))]
    for worker_id in promote:
        router.set_state(worker_id, rpb.WORKER_STATE_ACTIVE)
    num_warm = len(warm) - len(promote)
    surplus = active[: max(0, len(active) - decision.num_active)]
    demote = surplus[: max(0, decision.num_warm - num_warm)]
    for worker_id in demote:
        router.set_state(worker_id, rpb.WORKER_STATE_WARM)
    to_drain = surplus[len(demote):] + warm[len(promote):][: max(0, num_warm - decision.num_warm)]
    for worker_id in to_drain:
        router.set_state(worker_id, rpb.WORKER_STATE_DRAINING)
    return to_drain


def _least_busy(workers: dict[str, rpb.WorkerStatus], state: int) -> list[str]:
    chosen = sorted((w for w in workers.values() if w.state == state),
                    key=lambda w: (w.num_inflight, w.load.num_running + w.load.num_waiting, w.worker.worker_id))
    return [w.worker.worker_id for w in chosen]


def _idle(worker: rpb.WorkerStatus) -> bool:
    return worker.num_inflight == 0 and worker.load.num_running + worker.load.num_waiting == 0


def _epoch_or_none(value: float) -> float | None:
    return None if value == NEVER else round(value, 3)


def _iso(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))
