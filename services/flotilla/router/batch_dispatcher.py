"""The fixed-batch dispatcher: calls of fixed-batch models (rpc BatchGenerateSession) batched onto idle
fixed-batch workers' RunBatch.

    pending:  per model, TierQueues (batch_queue.py): paid before free
    inflight: batch_id -> InFlight(worker, calls, attempt)
    loop:     while a model's queue is due (B pending, or the oldest waited T) and one of its workers is idle:
                take up to B (the idle worker's B), paid first, dropping calls past their deadline;
                RunBatch on that worker; resolve each call with its own output, in order
    failure:  the batch goes back (ahead of new batches) to another idle worker, attempt + 1, at most
              max_attempts, its expired calls dropped first; then every call fails UNAVAILABLE

Every call is resolved exactly once (`_resolve`): with its output, DEADLINE_EXCEEDED (dropped before a
dispatch), OVERLOADED (queue full, or no worker took it within max_queue_wait_s), UNAVAILABLE (attempts spent)
or MODEL_NOT_FOUND. A worker is idle while it is healthy, ACTIVE and runs no batch of ours; one call at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.router.batch_queue import PAID, PendingCall, TierQueues
from flotilla.router.registry import WorkerEntry, WorkerRegistry

logger = logging.getLogger(__name__)

Resolve = Callable[[rpb.BatchResult], None]
EXPIRY_SWEEP_S = 0.05  # deadline and give-up checks of waiting calls, while any wait
_WORKER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class BatchSettings:
    """`max_wait_ms` is T; None derives it from the p95 budget: T = budget - 2 L (a call may wait T, then up to
    one L for a worker that just started a batch, then its own L), at least 0."""

    latency_budget_ms: float = 500.0
    max_wait_ms: float | None = None
    max_attempts: int = 3  # workers one batch may run on
    call_timeout_s: float = 30.0  # a RunBatch taking longer counts as a worker failure
    max_queue_depth: int = 100_000  # waiting calls per model; beyond: OVERLOADED at once
    max_queue_wait_s: float = 30.0  # a call no worker took this long fails OVERLOADED / UNAVAILABLE
    tier_order: tuple[str, ...] = (PAID, "free")

    def __post_init__(self) -> None:
        if self.latency_budget_ms <= 0 or (self.max_wait_ms is not None and self.max_wait_ms < 0):
            raise ValueError("latency_budget_ms must be > 0 and max_wait_ms >= 0")
        if self.max_attempts < 1 or self.call_timeout_s <= 0 or self.max_queue_depth < 1:
            raise ValueError("max_attempts, call_timeout_s and max_queue_depth must be positive")

    def flush_wait_s(self, latency_ms: float) -> float:
        if self.max_wait_ms is not None:
            return self.max_wait_ms / 1000
        return max(0.0, self.latency_budget_ms - 2 * latency_ms) / 1000


@dataclass(eq=False)
class InFlight:
    batch_id: str
    model: str
    calls: list[PendingCall]
    attempt: int = 0
    worker_id: str = ""  # "" while it waits to be re-dispatched
    avoid: set[str] = field(default_factory=set)  # workers it failed on
    last_error: str = ""


@dataclass
class _Model:
    queues: TierQueues
    retries: deque[InFlight] = field(default_factory=deque)


class BatchDispatcher:
    def __init__(self, registry: WorkerRegistry, settings: BatchSettings = BatchSettings(),
                 expected_models: frozenset[str] = frozenset(), clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self._registry = registry
        self.settings = settings
        self._expected = expected_models
        self._clock = clock
        self._wall_clock = wall_clock
        self._models: dict[str, _Model] = {}
        self.inflight: dict[str, InFlight] = {}
        self._busy: dict[str, str] = {}  # worker id -> batch id it runs
        self._batch_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._last_sweep_s = 0.0
        self._tasks: set[asyncio.Task] = set()
        self.num_batches = 0
        self.num_dispatched_calls = 0

    # ---- callers -----------------------------------------------------------------------------------
    def submit(self, call: rpb.BatchCall, resolve: Resolve) -> PendingCall | None:
        """Queue one call; None when it was answered at once (unknown model, queue full)."""
        now = self._clock()
        pending = PendingCall(call.call_id, call.input, call.tier or "free", now, resolve,
                              request_id=call.request_id, give_up_s=now + self.settings.max_queue_wait_s)
        if call.deadline_unix_s > 0:
            pending.deadline_s = now + (call.deadline_unix_s - self._wall_clock())
        if not self._registry.fixed_batch_workers(call.model) and call.model not in self._expected:
            self._fail(pending, pb.ERROR_CODE_MODEL_NOT_FOUND, f"no fixed-batch worker serves {call.model!r}")
            return None
        model = self._models.get(call.model)
        if model is None:
            model = self._models[call.model] = _Model(TierQueues(self.settings.tier_order))
        if len(model.queues) >= self.settings.max_queue_depth:
            self._fail(pending, pb.ERROR_CODE_OVERLOADED, "the batch queue is full; retry later",
                       retry_after_s=self._latency_s(call.model) or 1.0)
            return None
        if pending.deadline_s <= now:
            self._fail(pending, pb.ERROR_CODE_DEADLINE_EXCEEDED, "deadline passed before the call was queued")
            return None
        model.queues.add(pending)
        self.wake()
        return pending

    def cancel(self, pending: PendingCall, model: str) -> None:
        """The caller went away: a queued call is skipped; a dispatched one's output is dropped."""
        queues = self._models.get(model)
        if queues is not None:
            queues.queues.cancel(pending)
        pending.cancelled = True

    def wake(self) -> None:
        """Something changed (a call, a worker registered, heartbeat or finished): look again."""
        self._wake.set()

    def queue_depth(self, model: str) -> int:
        entry = self._models.get(model)
        return len(entry.queues) if entry is not None else 0

    # ---- the loop ----------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wake.clear()
                next_s = self.step()
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                if next_s is not None:
                    delay = max(0.0, next_s - self._clock())
                    self._timer = loop.call_later(delay, self._wake.set)
                await self._wake.wait()
        finally:
            self._stop()

    def step(self) -> float | None:
        """Dispatch what can go now; the time of the next size-or-time or expiry check (None: nothing waits)."""
        now = self._clock()
        sweep = now - self._last_sweep_s >= EXPIRY_SWEEP_S
        if sweep:
            self._last_sweep_s = now
        next_s: float | None = None
        for name, model in self._models.items():
            if sweep:
                self._expire(name, model, now)
            self._dispatch_model(name, model, now)
            wait_s = self.settings.flush_wait_s(self._latency_ms(name))
            due_s = model.queues.next_due_s(wait_s)
            if due_s is not None or model.retries:
                # Waiting calls: their flush time, and the expiry sweep meanwhile.
                candidates = [now + EXPIRY_SWEEP_S] + ([due_s] if due_s is not None else [])
                next_s = min([*candidates, *([next_s] if next_s is not None else [])])
        return next_s

    def _dispatch_model(self, name: str, model: _Model, now: float) -> None:
        while model.retries:
            flight = model.retries[0]
            worker = self._idle_worker(name, flight.avoid)
            if worker is None:
                break
            model.retries.popleft()
            self._drop_expired(flight, now)
            if flight.calls:
                self._start(flight, worker)
            else:
                self.inflight.pop(flight.batch_id, None)
        if model.retries:
            return  # re-dispatched batches go before new ones
        wait_s = self.settings.flush_wait_s(self._latency_ms(name))
        while len(model.queues):
            worker = self._idle_worker(name)
            if worker is None:
                return
            max_batch_size = worker.info.fixed_batch.max_batch_size or 1
            if not model.queues.is_due(now, max_batch_size, wait_s):
                return
            taken = model.queues.take(max_batch_size, now)
            for call in taken.expired:
                self._fail(call, pb.ERROR_CODE_DEADLINE_EXCEEDED, "deadline passed before the call was dispatched")
            if not taken.calls:
                continue
            flight = InFlight(f"batch-{next(self._batch_ids)}", name, taken.calls)
            self.inflight[flight.batch_id] = flight
            self._start(flight, worker)

    def _idle_worker(self, name: str, avoid: set[str] = frozenset()) -> WorkerEntry | None:
        """An idle worker of the model, one the batch has not failed on when there is such a worker at all."""
        idle = [e for e in self._registry.fixed_batch_workers(name)
                if e.worker_id not in self._busy and self._registry.can_take_batch(e)]
        fresh = [e for e in idle if e.worker_id not in avoid]
        if fresh:
            return min(fresh, key=lambda e: e.worker_id)
        others = [e for e in self._registry.fixed_batch_workers(name) if e.worker_id not in avoid
                  and self._registry.can_take_batch(e)]
        return min(idle, key=lambda e: e.worker_id) if idle and not others else None

    def _start(self, flight: InFlight, worker: WorkerEntry) -> None:
        flight.attempt += 1
        flight.worker_id = worker.worker_id
        self._busy[worker.worker_id] = flight.batch_id
        self.num_batches += 1
        self.num_dispatched_calls += len(flight.calls)
        dispatched_s = self._clock()
        task = asyncio.get_running_loop().create_task(self._run(flight, worker, dispatched_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, flight: InFlight, worker: WorkerEntry, dispatched_s: float) -> None:
        request = wpb.RunBatchRequest(batch_id=flight.batch_id, attempt=flight.attempt,
                                      inputs=[call.input for call in flight.calls])
        worker.num_inflight += 1  # its channel stays open while the call runs, even if it deregisters
        try:
            response = await worker.batch_stub.RunBatch(request, timeout=self.settings.call_timeout_s)
            if len(response.outputs) != len(flight.calls):
                raise _Broken(f"{len(response.outputs)} outputs for {len(flight.calls)} inputs")
        except (grpc.aio.AioRpcError, _Broken) as exc:
            self._busy.pop(worker.worker_id, None)
            self._on_failure(flight, worker, exc)
        else:
            self._busy.pop(worker.worker_id, None)
            self.inflight.pop(flight.batch_id, None)
            self._answer(flight, worker.worker_id, list(response.outputs), dispatched_s)
        finally:
            worker.num_inflight -= 1
            self.wake()

    def _answer(self, flight: InFlight, worker_id: str, outputs: list[str], dispatched_s: float) -> None:
        size = len(flight.calls)
        for index, (call, output) in enumerate(zip(flight.calls, outputs)):
            self._resolve(call, rpb.BatchResult(
                call_id=call.call_id, output=output, batch_id=flight.batch_id, batch_index=index, batch_size=size,
                num_attempts=flight.attempt, worker_id=worker_id, queued_s=dispatched_s - call.arrived_s))

    def _on_failure(self, flight: InFlight, worker: WorkerEntry, exc: Exception) -> None:
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        if code in _WORKER_GONE:
            self._registry.mark_failed(worker.worker_id)  # no new batches until its next heartbeat
        reason = f"{code.name}: {exc.details()}" if code is not None else str(exc)
        flight.last_error = f"worker {worker.worker_id} failed ({reason})"
        flight.avoid.add(worker.worker_id)
        flight.worker_id = ""
        logger.warning("batch %s (%d calls) failed on %s, attempt %d of %d: %s", flight.batch_id,
                       len(flight.calls), worker.worker_id, flight.attempt, self.settings.max_attempts, reason)
        flight.calls = [call for call in flight.calls if call.is_live]
        if flight.attempt >= self.settings.max_attempts or not flight.calls:
            self.inflight.pop(flight.batch_id, None)
            for call in flight.calls:
                self._fail(call, pb.ERROR_CODE_UNAVAILABLE,
                           f"the batch failed on {flight.attempt} workers, last: {flight.last_error}; retry",
                           retry_after_s=1.0)
            return
        model = self._models[flight.model]
        model.retries.append(flight)

    # ---- ends --------------------------------------------------------------------------------------
    def _expire(self, name: str, model: _Model, now: float) -> None:
        expired = model.queues.expire(now)
        for flight in list(model.retries):  # batches waiting for a worker to re-run them
            expired += [call for call in flight.calls if min(call.deadline_s, call.give_up_s) <= now]
            flight.calls = [call for call in flight.calls if call.is_live and min(call.deadline_s, call.give_up_s) > now]
            if not flight.calls:
                model.retries.remove(flight)
                self.inflight.pop(flight.batch_id, None)
        for call in expired:
            if call.deadline_s <= now:
                self._fail(call, pb.ERROR_CODE_DEADLINE_EXCEEDED, "deadline passed before the call was dispatched")
            elif any(self._registry.can_take_batch(e) for e in self._registry.fixed_batch_workers(name)):
                self._fail(call, pb.ERROR_CODE_OVERLOADED, "no worker took the call in time; retry later",
                           retry_after_s=1.0)
            else:
                self._fail(call, pb.ERROR_CODE_UNAVAILABLE, f"no healthy worker serves {name!r}; retry later",
                           retry_after_s=1.0)

    def _drop_expired(self, flight: InFlight, now: float) -> None:
        kept = []
        for call in flight.calls:
            if call.deadline_s <= now:
                self._fail(call, pb.ERROR_CODE_DEADLINE_EXCEEDED, "deadline passed before the batch was re-dispatched")
            elif call.is_live:
                kept.append(call)
        flight.calls = kept

    def _fail(self, call: PendingCall, code: int, message: str, retry_after_s: float = 0.0) -> None:
        self._resolve(call, rpb.BatchResult(call_id=call.call_id, error=pb.Error(
            code=code, message=message, retry_after_s=retry_after_s)))

    @staticmethod
    def _resolve(call: PendingCall, result: rpb.BatchResult) -> None:
        """The one way a call is answered: at most once, and never once the caller went away."""
        if not call.is_live:
            return
        call.resolved = True
        call.resolve(result)

    def _latency_ms(self, name: str) -> float:
        return max((e.info.fixed_batch.batch_latency_ms for e in self._registry.fixed_batch_workers(name)),
                   default=0)

    def _latency_s(self, name: str) -> float:
        return self._latency_ms(name) / 1000

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        for flight in list(self.inflight.values()):
            for call in flight.calls:
                self._fail(call, pb.ERROR_CODE_UNAVAILABLE, "the router is stopping; retry", retry_after_s=1.0)
        for model in self._models.values():
            for call in model.queues.drain():
                self._fail(call, pb.ERROR_CODE_UNAVAILABLE, "the router is stopping; retry", retry_after_s=1.0)


class _Broken(Exception):
    """A worker answered a batch with the wrong number of outputs."""
