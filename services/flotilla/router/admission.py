"""Admission: resolve the model, place the request on a worker now, or queue it (bounded, per model name).

Queued requests leave in arrival order: whenever load changes (a heartbeat, a registration, a finished
request) `dispatch()` places queue heads while some worker has room. A request waits up to its deadline or
`max_queue_wait_s`, then fails UNAVAILABLE (no healthy worker serves its model) or OVERLOADED (all busy);
a full queue answers OVERLOADED at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.router.models import ModelNotFoundError, Resolution, resolve_model
from flotilla.router.placement import PlacementLimits, choose_worker
from flotilla.router.registry import WorkerEntry, WorkerRegistry


class RouterError(Exception):
    """A request the router answers with an Error event instead of tokens."""

    def __init__(self, code: int, message: str, field: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Placement:
    worker: WorkerEntry
    resolution: Resolution


@dataclass(eq=False)
class _Waiter:
    requested: str
    num_prompt_tokens: int
    future: asyncio.Future[Placement]


class Admission:
    def __init__(
        self,
        registry: WorkerRegistry,
        aliases: Mapping[str, str],
        expected_names: Collection[str],
        limits: PlacementLimits,
        max_queue_depth: int,
        max_queue_wait_s: float,
        wall_clock: Callable[[], float] = time.time,
    ):
        self._registry = registry
        self._aliases = dict(aliases)
        self._expected_names = frozenset(expected_names)
        self._limits = limits
        self._max_queue_depth = max_queue_depth
        self._max_queue_wait_s = max_queue_wait_s
        self._wall_clock = wall_clock
        self._queues: dict[str, deque[_Waiter]] = {}

    def resolve(self, requested: str) -> Resolution:
        if not requested:
            raise RouterError(pb.ERROR_CODE_INVALID_REQUEST, "model must not be empty", "model")
        try:
            return resolve_model(requested, self._registry.model_versions(), self._aliases, self._expected_names)
        except ModelNotFoundError as exc:
            raise RouterError(pb.ERROR_CODE_MODEL_NOT_FOUND, str(exc), "model") from None

    def queue_depth(self, name: str) -> int:
        return len(self._queues.get(name, ()))

    def queued_tokens(self, name: str) -> int:
        """Prompt tokens waiting in this model's queue (autoscaler signal)."""
        return sum(w.num_prompt_tokens for w in self._queues.get(name, ()) if not w.future.done())

    async def acquire(self, requested: str, num_prompt_tokens: int, deadline_unix_s: float = 0.0) -> Placement:
        """A worker for this request, now or after queueing; raises RouterError."""
        resolution = self.resolve(requested)
        queue = self._queues.setdefault(resolution.name, deque())
        if not queue:  # nobody waits ahead of us
            placement = self._try_place(requested, num_prompt_tokens)
            if placement is not None:
                return placement
        if len(queue) >= self._max_queue_depth:
            raise RouterError(pb.ERROR_CODE_OVERLOADED, f"queue for {resolution.name!r} is full")
        waiter = _Waiter(requested, num_prompt_tokens, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        try:
            await asyncio.wait([waiter.future], timeout=self._wait_budget(deadline_unix_s))
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            _discard(queue, waiter)
        if waiter.future.cancelled():
            raise self._timeout_error(resolution.name)
        return waiter.future.result()

    def dispatch(self) -> None:
        """Place queue heads, in order, while workers have room."""
        for queue in self._queues.values():
            while queue:
                waiter = queue[0]
                if waiter.future.done():
                    queue.popleft()
                    continue
                try:
                    placement = self._try_place(waiter.requested, waiter.num_prompt_tokens)
                except RouterError as exc:  # its version went away while it waited
                    queue.popleft()
                    waiter.future.set_exception(exc)
                    continue
                if placement is None:
                    break
                queue.popleft()
                waiter.future.set_result(placement)

    def _try_place(self, requested: str, num_prompt_tokens: int) -> Placement | None:
        resolution = self.resolve(requested)
        if resolution.version is None:
            return None
        workers = {e.worker_id: e for e in self._registry.healthy_workers(resolution.name, resolution.version)}
        loads = [self._registry.load_of(e) for e in workers.values()]
        chosen = choose_worker(loads, num_prompt_tokens, self._limits)
        if chosen is None:
            return None
        self._registry.record_placement(workers[chosen], num_prompt_tokens)
        return Placement(workers[chosen], resolution)

    def _wait_budget(self, deadline_unix_s: float) -> float:
        budget = self._max_queue_wait_s
        if deadline_unix_s > 0:
            budget = min(budget, deadline_unix_s - self._wall_clock())
        return max(0.0, budget) if math.isfinite(budget) else self._max_queue_wait_s

    def _timeout_error(self, name: str) -> RouterError:
        if not self._registry.has_healthy_worker(name):
            return RouterError(pb.ERROR_CODE_UNAVAILABLE, f"no healthy worker serves {name!r} now")
        return RouterError(pb.ERROR_CODE_OVERLOADED, f"every worker serving {name!r} is busy")


def _discard(queue: deque[_Waiter], waiter: _Waiter) -> None:
    try:
        queue.remove(waiter)
    except ValueError:
        pass
