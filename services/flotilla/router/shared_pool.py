"""The router's side of the shared pool for rarely used models (workers started with `--shared-models`).

A shared-pool worker registers every model it can load (WorkerInfo.shared) and reports the ones loaded now,
least recently used first (LoadReport.loaded_models; at once after each load or unload). A request for such a
model is placed only on a worker that holds it loaded (`placeable`); when none does, `ensure_loading` asks one
worker to load it (LoadModel) and the request waits in the admission queue like any cold start: up to its
deadline or the cold-start bound, then MODEL_STARTING with a Retry-After. The worker for a load is one with a
free slot, else the least recently used one (the router's last placement there is oldest); that worker then
unloads its own least recently used model without live streams.

When every worker holding a model is full (placement found no room), the model is loaded on one more worker, but
only into a free slot. While a load this router asked for runs on a worker, the router places nothing new there: the model it unloads
is not known until the load answers, and streams placed on it would only delay the unload.

Load times are measured per model (an EWMA of what LoadModel answered), so the wait estimate of a request for
an unloaded model includes the load (`expected_load_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.observability.buckets import LATENCY_BUCKETS
from flotilla.router.registry import WorkerEntry, WorkerRegistry

logger = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT_S = 600.0
LOAD_RETRY_BACKOFF_S = 5.0  # after a failed load, the same model is not asked for again this long


@dataclass(frozen=True)
class SharedWorkerView:
    """What choosing a worker for a load needs to know of one shared-pool worker."""

    worker_id: str
    num_loaded: int
    max_loaded: int
    last_used: float  # the router's last placement there (0: never)


def choose_load_worker(views: Sequence[SharedWorkerView]) -> str | None:
    """The worker that loads a model none holds: one with a free slot (fewest loaded), else the least recently
    used; the worker id breaks ties. None without candidates."""
    if not views:
        return None
    free = [v for v in views if v.num_loaded < v.max_loaded]
    if free:
        return min(free, key=lambda v: (v.num_loaded, v.last_used, v.worker_id)).worker_id
    return min(views, key=lambda v: (v.last_used, v.worker_id)).worker_id


class LoadTimes:
    """Seconds a model's load took, smoothed (EWMA) per name@version; unknown until one was measured."""

    def __init__(self, alpha: float = 0.5):
        self.alpha = alpha
        self._seconds: dict[str, float] = {}

    def observe(self, qualified: str, seconds: float) -> None:
        old = self._seconds.get(qualified)
        self._seconds[qualified] = seconds if old is None else self.alpha * seconds + (1 - self.alpha) * old

    def estimate(self, qualified: str) -> float | None:
        return self._seconds.get(qualified)


@dataclass
class _Load:
    worker_id: str
    started: float
    task: asyncio.Task | None = None


class SharedPoolMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.loads = Counter("flotilla_router_shared_model_loads", "Loads the router asked of shared-pool workers, "
                             "by model and outcome (loaded, failed)", ["model", "outcome"], registry=registry)
        self.load_seconds = Histogram("flotilla_router_shared_model_load_seconds", "How long a shared-pool "
                                      "worker took to load a model (its cold start)", ["model"],
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.unloads = Counter("flotilla_router_shared_model_unloads", "Models a shared-pool worker unloaded to "
                               "make room, by model", ["model"], registry=registry)


class SharedPool:
    def __init__(self, registry: WorkerRegistry, metrics: SharedPoolMetrics | None = None,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self._registry = registry
        self._metrics = metrics
        self._load_timeout_s = load_timeout_s
        self._clock = clock
        self.on_change: Callable[[], None] = lambda: None  # admission.dispatch: a finished load places waiters
        self._loads: dict[str, _Load] = {}  # name@version -> the load in flight
        self._failed_at: dict[str, float] = {}
        self._last_used: dict[str, float] = {}  # worker id -> last placement there
        self.load_times = LoadTimes()

    # ---- placement -----------------------------------------------------------------------------------
    def is_shared_model(self, name: str) -> bool:
        return any(m.name == name for e in self._registry.shared_workers() for m in e.info.shared.models)

    def placeable(self, name: str, version: str) -> list[WorkerEntry]:
        """Healthy, active shared-pool workers that hold name@version loaded and load nothing for us now."""
        qualified = f"{name}@{version}"
        loading_on = {load.worker_id for load in self._loads.values()}
        return [e for e in self._candidates(qualified) if e.has_loaded(qualified) and e.worker_id not in loading_on]

    @staticmethod
    def holds(entry: WorkerEntry, name: str) -> bool:
        """A shared-pool worker holds some version of `name` loaded (its queue counts in that model's wait)."""
        return entry.is_shared and any(q.partition("@")[0] == name for q in entry.report.loaded_models)

    def placed(self, entry: WorkerEntry) -> None:
        if entry.is_shared:
            self._last_used[entry.worker_id] = self._clock()

    def ensure_loading(self, name: str, version: str, spread: bool = False) -> None:
        """Ask one worker to load name@version unless one holds it, loads it, or its last load just failed.
        `spread`: the workers holding it are full, so load it on one more, but only into a free slot (a busy rare
        model does not unload another model)."""
        qualified = f"{name}@{version}"
        candidates = self._candidates(qualified)
        if (qualified in self._loads or not candidates
                or any(e.report.loading_model == qualified for e in candidates)
                or (not spread and any(e.has_loaded(qualified) for e in candidates))
                or self._clock() - self._failed_at.get(qualified, -LOAD_RETRY_BACKOFF_S) < LOAD_RETRY_BACKOFF_S):
            return
        loading_on = {load.worker_id for load in self._loads.values()}
        views = [SharedWorkerView(e.worker_id, len(e.report.loaded_models), e.info.shared.max_loaded_models or 1,
                                  self._last_used.get(e.worker_id, 0.0))
                 for e in candidates if e.worker_id not in loading_on and not e.has_loaded(qualified)]
        if spread:
            views = [v for v in views if v.num_loaded < v.max_loaded]
        chosen = choose_load_worker(views)
        if chosen is None:
            return  # every candidate is loading another model: the next dispatch tries again
        entry = self._registry.get(chosen)
        load = self._loads[qualified] = _Load(chosen, self._clock())
        load.task = asyncio.get_running_loop().create_task(self._load(entry, qualified))
        logger.info("asked shared worker %s to load %s", chosen, qualified)

    # ---- wait estimate -------------------------------------------------------------------------------
    def expected_load_s(self, name: str) -> float | None:
        """Seconds until `name` could run on the shared pool: 0 when a worker holds it, what remains of its
        load's measured duration otherwise; None when it is not a shared model or its load time is unknown."""
        qualified = [f"{m.name}@{m.version}" for e in self._registry.shared_workers()
                     for m in e.info.shared.models if m.name == name]
        if not qualified:
            return None
        if any(e.has_loaded(q) for e in self._registry.shared_workers() for q in qualified):
            return 0.0
        estimates = [s for q in qualified if (s := self.load_times.estimate(q)) is not None]
        if not estimates:
            return None
        elapsed = max((self._clock() - self._loads[q].started for q in qualified if q in self._loads), default=0.0)
        return max(0.0, min(estimates) - elapsed)

    # ---- internals -----------------------------------------------------------------------------------
    def _candidates(self, qualified: str) -> list[WorkerEntry]:
        name, _, version = qualified.partition("@")
        return [e for e in self._registry.shared_workers()
                if self._registry.is_healthy(e) and e.state == rpb.WORKER_STATE_ACTIVE
                and any(m.name == name and m.version == version for m in e.info.shared.models)]

    async def _load(self, entry: WorkerEntry, qualified: str) -> None:
        name = qualified.partition("@")[0]
        try:
            response = await entry.stub.LoadModel(wpb.LoadModelRequest(model=qualified), timeout=self._load_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._failed_at[qualified] = self._clock()
            logger.warning("shared worker %s could not load %s: %s %s", entry.worker_id, qualified, exc.code().name,
                           exc.details())
            if self._metrics is not None:
                self._metrics.loads.labels(name, "failed").inc()
        else:
            # The router's view follows the answer at once (the next heartbeat says the same).
            entry.report.loaded_models[:] = response.loaded_models
            entry.report.loading_model = ""
            self._record(entry, qualified, response)
        finally:
            self._loads.pop(qualified, None)
            self.on_change()

    def _record(self, entry: WorkerEntry, qualified: str, response: wpb.LoadModelResponse) -> None:
        name = qualified.partition("@")[0]
        if not response.already_loaded:
            self.load_times.observe(qualified, response.load_seconds)
        logger.info("shared worker %s loaded %s in %.2f s%s (loaded: %s)", entry.worker_id, qualified,
                    response.load_seconds, f", unloading {', '.join(response.unloaded_models)}"
                    if response.unloaded_models else "", ", ".join(response.loaded_models))
        if self._metrics is None:
            return
        self._metrics.loads.labels(name, "loaded").inc()
        if not response.already_loaded:
            self._metrics.load_seconds.labels(name).observe(response.load_seconds)
        for unloaded in response.unloaded_models:
            self._metrics.unloads.labels(unloaded.partition("@")[0]).inc()
