"""The local supervisor: the control law against worker processes on this machine (`flotilla up --autoscale`).

Every tick it reads the pool's signals from the router, asks the control law for a decision and applies it:
promote warm workers (router state ACTIVE: in rotation at once, their weights are loaded), demote or drain
active ones, start new workers (declared WARM in the router before they start, so they never take traffic
before the next decision promotes them) and stop drained ones once the router relays nothing from them and
their last load reports show no running or waiting request and no KV hand-off for `drain_settle_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.autoscaling.control import Decision, ScalerState, decide
from flotilla.autoscaling.drain import holds_work
from flotilla.autoscaling.policy import PoolPolicy
from flotilla.autoscaling.router_client import RouterClient
from flotilla.observability.autoscaler import AutoscalerMetrics

logger = logging.getLogger(__name__)


class ReplicaLauncher(Protocol):
    """Starts and stops worker processes; never blocks on them."""

    def next_replica_id(self) -> str: ...

    def start_replica(self, replica_id: str) -> None: ...

    def stop_replica(self, replica_id: str) -> None: ...

    def is_running(self, replica_id: str) -> bool: ...


@dataclass(frozen=True)
class SupervisorConfig:
    model: str
    policy: PoolPolicy
    interval_s: float = 0.1  # tick period
    window_s: float = 10.0  # TTFT and token-mix window asked of the router
    drain_settle_s: float = 0.6  # a draining worker must look idle this long (> a heartbeat) before it stops


@dataclass(frozen=True)
class ScalingEvent:
    at_s: float
    reason: str
    promoted: tuple[str, ...] = ()
    demoted: tuple[str, ...] = ()
    drained: tuple[str, ...] = ()
    started: tuple[str, ...] = ()


@dataclass
class _Draining:
    idle_since_s: float | None = None


@dataclass
class LocalSupervisor:
    config: SupervisorConfig
    router: RouterClient
    launcher: ReplicaLauncher
    clock: Callable[[], float] = time.monotonic
    state: ScalerState = field(default_factory=ScalerState)
    events: list[ScalingEvent] = field(default_factory=list)
    _starting: set[str] = field(default_factory=set)
    _draining: dict[str, _Draining] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    metrics: AutoscalerMetrics | None = None  # set on every tick (desired vs actual replicas)

    # ---- one tick ----------------------------------------------------------------------------------
    def tick(self) -> Decision:
        now = self.clock()
        statuses = {s.worker.worker_id: s for s in self.router.workers(self.config.model)}
        self._starting = {r for r in self._starting if r not in statuses and self.launcher.is_running(r)}
        self._finish_drains(statuses, now)
        signals = self.router.signals(self.config.model, self.config.window_s)
        decision = decide(self.config.policy, signals, self.state, now, len(self._starting))
        self.state = decision.state
        if self.metrics is not None:
            self.metrics.set(self.config.model, self.config.model, "both",
                             desired=decision.num_active + decision.num_warm,
                             actual=signals.num_active + signals.num_warm,
                             active=signals.num_active, warm=signals.num_warm)  # fmt: skip
        if decision.changed:
            event = self._apply(decision, statuses, now)
            self.events.append(event)
            logger.info("autoscaler: %s", decision.reason)
        return decision

    def _apply(self, decision: Decision, statuses: dict[str, rpb.WorkerStatus], now: float) -> ScalingEvent:
        warm = _ids_in(statuses, rpb.WORKER_STATE_WARM)
        active = _ids_in(statuses, rpb.WORKER_STATE_ACTIVE)
        promoted = warm[: decision.num_promote]
        retired = warm[decision.num_promote:][: decision.num_retire_warm]
        demoted = active[: decision.num_demote]
        drained = active[decision.num_demote:][: decision.num_drain]
        for replica_id in promoted:
            self.router.set_state(replica_id, rpb.WORKER_STATE_ACTIVE)
        for replica_id in demoted:
            self.router.set_state(replica_id, rpb.WORKER_STATE_WARM)
        for replica_id in [*drained, *retired]:
            self.router.set_state(replica_id, rpb.WORKER_STATE_DRAINING)
            self._draining[replica_id] = _Draining()
        started = tuple(self._start_one() for _ in range(decision.num_start))
        return ScalingEvent(now, decision.reason, tuple(promoted), tuple(demoted), tuple(drained + retired), started)

    def _start_one(self) -> str:
        replica_id = self.launcher.next_replica_id()
        self.router.set_state(replica_id, rpb.WORKER_STATE_WARM)  # out of rotation from its first heartbeat
        self.launcher.start_replica(replica_id)
        self._starting.add(replica_id)
        return replica_id

    def _finish_drains(self, statuses: dict[str, rpb.WorkerStatus], now: float) -> None:
        for replica_id, draining in list(self._draining.items()):
            status = statuses.get(replica_id)
            if status is not None and holds_work(status):
                draining.idle_since_s = None
                continue
            if draining.idle_since_s is None:
                draining.idle_since_s = now
            if status is None or now - draining.idle_since_s >= self.config.drain_settle_s:
                logger.info("autoscaler: %s drained; stopping it", replica_id)
                self.launcher.stop_replica(replica_id)
                del self._draining[replica_id]

    # ---- background thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):  # a periodic timer, not a wait for something
            try:
                self.tick()
            except grpc.RpcError as exc:  # router restarting: try again next tick
                logger.warning("autoscaler tick failed: %s", exc.code())
            except Exception:
                logger.exception("autoscaler tick failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.router.close()


def _ids_in(statuses: dict[str, rpb.WorkerStatus], state: int) -> list[str]:
    """Worker ids in this state, least busy first (fewest relayed streams, then fewest running)."""
    chosen = [s for s in statuses.values() if s.state == state]
    chosen.sort(key=lambda s: (s.num_inflight, s.load.num_running + s.load.num_waiting, s.worker.worker_id))
    return [s.worker.worker_id for s in chosen]
