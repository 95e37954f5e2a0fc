"""Admission: resolve the model, place the request on a worker now, or queue it.

One queue per model and priority class (interactive before batch); inside a class, deficit round robin on
tokens between tenants (fair_queue.py). Whenever load changes (a heartbeat, a registration, a finished
request) `dispatch()` places queue heads while some worker has room; a head whose deadline has passed is
rejected there (DEADLINE_EXCEEDED), not served late. Before queueing, the request's estimated wait (tokens
queued ahead in its class and above / measured fleet throughput) is checked against its `max_queue_wait_s`:
beyond it, OVERLOADED at once with a retry_after_s from the drain rate. A request waits up to its deadline
or `max_queue_wait_s`, then fails UNAVAILABLE (no healthy worker serves its model) or OVERLOADED (all
busy); a full class queue (bounded depth) answers OVERLOADED at once.

Long-context pool (context_pools.py): a prompt over its model's threshold waits in a lane of its own while
the model has long-context workers, so a long request waiting for that pool holds up no short one; short
requests use a long-context worker only while no long request waits or runs there.

Cold start: a request for a known model with no active replica (its pool scaling from zero) waits up to its
deadline or `cold_start_wait_s`, then fails MODEL_STARTING ("model is starting", retry after a few seconds).
A model of the shared pool (shared_pool.py) is cold until a shared-pool worker holds it loaded: its request asks
for the load, and when the load's measured duration alone is beyond that bound it fails MODEL_STARTING at once
(with the load's remaining time as Retry-After) instead of waiting.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.rpc.convert import error_response
from flotilla.router.context_pools import DEFAULT_POOL, LONG_CONTEXT_POOL, PoolRequest
from flotilla.router.fair_queue import FairQueue
from flotilla.router.model_routes import ModelRoutes
from flotilla.router.models import ModelNotFoundError, Resolution, resolve_model
from flotilla.router.load_index import GroupKey
from flotilla.router.placement import PlacementLimits, WorkerLoad, choose_worker_in_order, headroom_key
from flotilla.router.registry import WorkerEntry, WorkerRegistry
from flotilla.router.shared_pool import SharedPool
from flotilla.router.wait_estimate import (ThroughputMeter, estimated_wait_s, overload_retry_after_s,
                                           starting_retry_after_s, with_load_time)

COLD_START_RETRY_AFTER_S = 5.0  # what a MODEL_STARTING answer tells the caller to wait

# Served in this order: a batch request is placed only while no interactive one waits for the same model.
CLASS_ORDER = (pb.PRIORITY_CLASS_INTERACTIVE, pb.PRIORITY_CLASS_BATCH)


class RouterError(Exception):
    """A request the router answers with an Error event instead of tokens."""

    def __init__(self, code: int, message: str, field: str = "", retry_after_s: float = 0.0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s

    def as_response(self) -> pb.GenerateResponse:
        """The Error event the caller gets for it (the relay's and the lease path's refusal alike)."""
        refusal = error_response(self.code, self.message, self.field)
        refusal.error.retry_after_s = self.retry_after_s
        return refusal


class Ticket(NamedTuple):
    """Who asks and how much: what fair queueing and the wait-budget check need beyond the model."""

    priority: int = pb.PRIORITY_CLASS_INTERACTIVE
    tenant: str = ""
    num_tokens: int = 0  # prompt + max_tokens; 0: the prompt only
    weight: int = 1
    max_queue_wait_s: float = 0.0  # 0: no wait-budget check
    affinity_key: str = ""  # the conversation, bucketed by a rollout's split (models.py)

    @classmethod
    def of(cls, request: pb.GenerateRequest) -> Ticket:
        priority = request.priority if request.priority in CLASS_ORDER else pb.PRIORITY_CLASS_INTERACTIVE
        return cls(priority, request.tenant_id, len(request.prompt_token_ids) + request.sampling.max_tokens,
                   max(1, request.tenant_weight), request.max_queue_wait_s,
                   request.affinity_key or request.request_id)


@dataclass(frozen=True)
class Placement:
    worker: WorkerEntry
    resolution: Resolution
    long_context: bool = False  # a long prompt: release the worker with the same flag (registry.release)


@dataclass(eq=False)
class _Waiter:
    requested: str
    num_prompt_tokens: int
    future: asyncio.Future[Placement]
    tenant: str = ""
    cost: int = 0
    weight: int = 1
    deadline_unix_s: float = 0.0
    avoid: frozenset[str] = frozenset()
    affinity_key: str = ""


@dataclass
class _ModelQueues:
    classes: dict[int, FairQueue[_Waiter]] = field(default_factory=lambda: {c: FairQueue() for c in CLASS_ORDER})

    def waiters(self) -> Iterator[_Waiter]:
        for queue in self.classes.values():
            yield from queue

    def tokens_ahead(self, ticket: Ticket) -> int:
        """Tokens served before a new request would be: everything in the classes served before its own,
        and in its own class what fair queueing puts ahead of it."""
        index = CLASS_ORDER.index(ticket.priority)
        before = sum(self.classes[c].num_tokens for c in CLASS_ORDER[:index])
        return before + self.classes[ticket.priority].tokens_ahead(ticket.tenant, ticket.num_tokens, ticket.weight)

    def has_waiters_ahead(self, priority: int) -> bool:
        return any(len(self.classes[c]) for c in CLASS_ORDER[: CLASS_ORDER.index(priority) + 1])

    def has_waiters_before(self, priority: int) -> bool:
        """Waiters in classes served before this one (not counting its own)."""
        return any(len(self.classes[c]) for c in CLASS_ORDER[: CLASS_ORDER.index(priority)])


class Admission:
    def __init__(
        self,
        registry: WorkerRegistry,
        routes: ModelRoutes | Mapping[str, str],  # the model registry, or just aliases (tests)
        expected_names: Collection[str],
        limits: PlacementLimits,
        max_queue_depth: int,
        max_queue_wait_s: float,
        wall_clock: Callable[[], float] = time.time,
        cold_start_wait_s: float | None = None,  # None: max_queue_wait_s
        shared: SharedPool | None = None,  # the shared pool's placement (default: one over this registry)
    ):
        self._registry = registry
        self.routes = routes if isinstance(routes, ModelRoutes) else ModelRoutes(routes)
        self._expected_names = frozenset(expected_names)
        self._limits = limits
        self._max_queue_depth = max_queue_depth
        self._max_queue_wait_s = max_queue_wait_s
        self._cold_start_wait_s = max_queue_wait_s if cold_start_wait_s is None else cold_start_wait_s
        self._wall_clock = wall_clock
        self._queues: dict[str, _ModelQueues] = {}
        self._long_queues: dict[str, _ModelQueues] = {}  # the long-context lane: prompts for that pool
        self.throughput = ThroughputMeter()
        self.shared = shared if shared is not None else SharedPool(registry)
        self.shared.on_change = self.dispatch  # a finished load places the requests waiting for it

    def resolve(self, requested: str, affinity_key: str = "") -> Resolution:
        """The version this request goes to now: a rollout's split buckets `affinity_key` (its conversation)."""
        if not requested:
            raise RouterError(pb.ERROR_CODE_INVALID_REQUEST, "model must not be empty", "model")
        versions = self._registry.model_versions()
        routes = self.routes
        routes.observe(versions)
        try:
            return resolve_model(requested, versions, routes.aliases, routes.expected_names(self._expected_names),
                                 routes.routes, affinity_key)
        except ModelNotFoundError as exc:
            raise RouterError(pb.ERROR_CODE_MODEL_NOT_FOUND, str(exc), "model") from None

    def queue_depth(self, name: str, priority: int | None = None) -> int:
        return sum(len(q) for queues in self._lanes(name) for c, q in queues.classes.items()
                   if priority is None or c == priority)

    def queue_depth_by_pool(self) -> dict[tuple[str, str], int]:
        """(model, pool the waiters are for) -> requests waiting: default and long-context lanes."""
        depths = {}
        for pool, lanes in ((DEFAULT_POOL, self._queues), (LONG_CONTEXT_POOL, self._long_queues)):
            for name, queues in lanes.items():
                depths[(name, pool)] = sum(1 for w in queues.waiters() if not w.future.done())
        return depths

    def _lanes(self, name: str) -> list[_ModelQueues]:
        return [lanes[name] for lanes in (self._queues, self._long_queues) if name in lanes]

    def queued_tokens(self, name: str) -> int:
        """Prompt tokens waiting in this model's queue (autoscaler signal)."""
        return sum(w.num_prompt_tokens for queues in self._lanes(name) for w in queues.waiters()
                   if not w.future.done())

    def waiting(self, name: str, pool: str = "") -> tuple[int, int]:
        """(requests, prompt tokens) waiting for this model: in both lanes, or for one pool (DEFAULT_POOL, or
        LONG_CONTEXT_POOL: its own lane), as the autoscaler scales that pool."""
        if not pool:
            return self.queue_depth(name), self.queued_tokens(name)
        queues = (self._long_queues if pool == LONG_CONTEXT_POOL else self._queues).get(name)
        pending = [w for w in queues.waiters() if not w.future.done()] if queues else []
        return len(pending), sum(w.num_prompt_tokens for w in pending)

    def estimated_wait_s(self, name: str, ticket: Ticket | None = None, long_lane: bool = False) -> float | None:
        """Tokens ahead (router queue + prompts not yet computed on the workers) / measured throughput;
        None while the fleet's throughput is unmeasured. `long_lane`: the ticket waits in the long-context lane."""
        queues = (self._long_queues if long_lane else self._queues).get(name)
        return self._wait_behind(name, queues.tokens_ahead(ticket or Ticket()) if queues else 0)

    def backlog_wait_s(self, name: str, priority: int = pb.PRIORITY_CLASS_INTERACTIVE) -> float | None:
        """The wait behind everything queued (both lanes) in this class and those served before it, every tenant's:
        an upper bound of any new request's estimated_wait_s in the class (fair queueing puts at most that ahead)."""
        classes = CLASS_ORDER[: CLASS_ORDER.index(priority) + 1]
        return self._wait_behind(name, sum(q.classes[c].num_tokens for q in self._lanes(name) for c in classes))

    def _wait_behind(self, name: str, num_queued_tokens: int) -> float | None:
        self._observe_throughput()
        registry = self._registry
        workers = [e for e in (*registry.token_workers_of(name), *registry.fixed_batch_workers(name),
                               *registry.shared_workers())
                   if registry.is_healthy(e) and (e.model_name == name or self.shared.holds(e, name))]
        ahead = num_queued_tokens + sum(self._registry.load_of(e).num_queued_tokens for e in workers)
        return with_load_time(estimated_wait_s(ahead, self.throughput.tokens_per_s(e.worker_id for e in workers)),
                              self.shared.expected_load_s(name))

    async def acquire(self, requested: str, num_prompt_tokens: int, deadline_unix_s: float = 0.0,
                      ticket: Ticket | None = None, avoid: frozenset[str] = frozenset()) -> Placement:
        """A worker for this request, now or after queueing; raises RouterError. `avoid`: workers a retried
        request was lost on, used only while no other healthy worker serves its model version."""
        ticket = ticket or Ticket(num_tokens=num_prompt_tokens)
        resolution = self.resolve(requested, ticket.affinity_key)
        long_lane = self._in_long_lane(resolution.name, num_prompt_tokens)
        queues = (self._long_queues if long_lane else self._queues).setdefault(resolution.name, _ModelQueues())
        idle = self._is_idle(resolution.name, ticket.tenant)
        # A tenant with nothing in flight starts at once (within the extra slots) even past its own class's
        # queue, never past a class served before its own.
        if not (queues.has_waiters_before(ticket.priority) if idle else queues.has_waiters_ahead(ticket.priority)):
            placement = self._try_place(requested, num_prompt_tokens, ticket.tenant, avoid, ticket.affinity_key,
                                        ticket.priority, resolution)
            if placement is not None:
                return placement
        cold = not self._registry.has_active_replica(resolution.name)
        if cold and self.shared.is_shared_model(resolution.name):
            self._check_load_time(resolution.name, requested, deadline_unix_s)
        else:
            self._check_wait_budget(resolution.name, ticket, long_lane)
        queue = queues.classes[ticket.priority]
        if len(queue) >= self._max_queue_depth:
            raise RouterError(pb.ERROR_CODE_OVERLOADED, f"queue for {resolution.name!r} is full",
                              retry_after_s=self._retry_after(resolution.name, ticket, long_lane))
        waiter = _Waiter(requested, num_prompt_tokens, asyncio.get_running_loop().create_future(), ticket.tenant,
                         max(ticket.num_tokens, num_prompt_tokens, 1), ticket.weight, deadline_unix_s, avoid,
                         ticket.affinity_key)
        queue.push(waiter)
        try:
            await asyncio.wait([waiter.future], timeout=self._wait_budget(deadline_unix_s, cold))
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            queue.discard(waiter)
        if waiter.future.cancelled():
            raise self._timeout_error(resolution.name, deadline_unix_s, requested)
        return waiter.future.result()

    def _in_long_lane(self, name: str, num_prompt_tokens: int) -> bool:
        """A long prompt of a model with long-context workers (in any state) queues in the long lane."""
        return self._limits.context.is_long(name, num_prompt_tokens) and self._registry.has_long_context_workers(name)

    def _long_waiting(self, name: str) -> bool:
        queues = self._long_queues.get(name)
        return queues is not None and any(not w.future.done() for w in queues.waiters())

    def _check_load_time(self, name: str, requested: str, deadline_unix_s: float) -> None:
        """A shared model that no worker holds: starting, at once, when its load alone outlasts the bound."""
        load_s = self.shared.expected_load_s(name)
        if load_s is not None and load_s > self._wait_budget(deadline_unix_s, cold=True):
            raise _model_starting(requested, starting_retry_after_s(load_s),
                                  f"loading it takes about {load_s:.0f} s, beyond this request's wait bound")

    def _check_wait_budget(self, name: str, ticket: Ticket, long_lane: bool = False) -> None:
        if ticket.max_queue_wait_s <= 0:
            return
        wait_s = self.estimated_wait_s(name, ticket, long_lane)
        if wait_s is not None and wait_s > ticket.max_queue_wait_s:
            raise RouterError(pb.ERROR_CODE_OVERLOADED,
                              f"{name!r} is overloaded: estimated queue wait {wait_s:.1f} s exceeds this "
                              f"request's budget of {ticket.max_queue_wait_s:.1f} s",
                              retry_after_s=overload_retry_after_s(wait_s, ticket.max_queue_wait_s))

    def _retry_after(self, name: str, ticket: Ticket, long_lane: bool = False) -> float:
        wait_s = self.estimated_wait_s(name, ticket, long_lane)
        return overload_retry_after_s(wait_s or 0.0, ticket.max_queue_wait_s)

    def _observe_throughput(self) -> None:
        # Runs on every dispatch(), which the service calls on every heartbeat: one sample per report, read only
        # for the workers that reported (or registered) since (a report seen twice would add nothing).
        for entry in self._registry.take_reported():
            report = entry.report
            busy = report.num_running + report.num_waiting > 0
            self.throughput.observe(entry.worker_id, report.num_output_tokens_total + report.num_prompt_tokens_total,
                                    busy, entry.last_heartbeat)

    def dispatch(self) -> None:
        """Place queue heads (interactive first, fair between tenants) while workers have room."""
        self._observe_throughput()
        for name, queues in [*self._queues.items(), *self._long_queues.items()]:  # lanes are independent
            for priority in CLASS_ORDER:
                if not self._dispatch_class(name, queues.classes[priority], priority):
                    break  # the head found no room: nothing of a later class may jump ahead of it

    def _dispatch_class(self, name: str, queue: FairQueue[_Waiter], priority: int) -> bool:
        """True when the class queue was emptied."""
        while (waiter := queue.peek()) is not None:
            if waiter.future.done():
                queue.pop()
                continue
            if 0 < waiter.deadline_unix_s <= self._wall_clock():
                queue.pop()
                waiter.future.set_exception(
                    RouterError(pb.ERROR_CODE_DEADLINE_EXCEEDED, "the request's deadline passed while it was queued")
                    if self._registry.has_active_replica(name) else self._starting(name, waiter.requested))
                continue
            try:
                placement = self._try_place(waiter.requested, waiter.num_prompt_tokens, waiter.tenant, waiter.avoid,
                                            waiter.affinity_key, priority)
            except RouterError as exc:  # its version went away while it waited
                queue.pop()
                waiter.future.set_exception(exc)
                continue
            if placement is None:
                return False
            queue.pop()
            waiter.future.set_result(placement)
        return True

    def _is_idle(self, name: str, tenant: str) -> bool:
        return self._registry.num_assigned_to_tenant(name, tenant) == 0

    def _try_place(self, requested: str, num_prompt_tokens: int, tenant: str = "",
                   avoid: frozenset[str] = frozenset(), affinity_key: str = "",
                   priority: int = pb.PRIORITY_CLASS_INTERACTIVE,
                   resolution: Resolution | None = None) -> Placement | None:
        """`resolution`: the request's, made just now (its first try, on arrival)."""
        # Resolved again at each try: a queued request follows a route change (a rollback) made while it waited.
        resolution = resolution or self.resolve(requested, affinity_key)
        if resolution.version is None:
            return None
        candidates = _Candidates(self._registry, resolution.name, resolution.version,
                                 self.shared.placeable(resolution.name, resolution.version))
        if not candidates.any(frozenset()) and self.shared.is_shared_model(resolution.name):
            self.shared.ensure_loading(resolution.name, resolution.version)  # the request waits for the load
            return None
        # A worker that just failed this request may still look healthy (a kill -9 can read as INTERNAL,
        # not UNAVAILABLE, and its heartbeats are not overdue yet): retry elsewhere while there is an elsewhere.
        skip = avoid if avoid and candidates.any(avoid) else frozenset()
        pools = PoolRequest(self._limits.context.is_long(resolution.name, num_prompt_tokens),
                            self._long_waiting(resolution.name))
        chosen = choose_worker_in_order(lambda pool: candidates.in_order(pool, skip), num_prompt_tokens,
                                        self._limits, self._is_idle(resolution.name, tenant),
                                        batch=priority == pb.PRIORITY_CLASS_BATCH, pools=pools,
                                        fewest_requests=lambda pool: candidates.fewest_requests(pool, skip))
        if chosen is None:
            if self.shared.is_shared_model(resolution.name):  # full where it is loaded: one more, if a slot is free
                self.shared.ensure_loading(resolution.name, resolution.version, spread=True)
            return None
        worker = self._registry.get(chosen)
        # Released (with the tenant, the long flag and the model) by the router service when the relay ends.
        self._registry.place(worker, num_prompt_tokens, tenant, pools.long_context, resolution.name)
        self.shared.placed(worker)
        return Placement(worker, resolution, pools.long_context)

    def _wait_budget(self, deadline_unix_s: float, cold: bool = False) -> float:
        budget = self._cold_start_wait_s if cold else self._max_queue_wait_s
        if deadline_unix_s > 0:
            budget = min(budget, deadline_unix_s - self._wall_clock())
        return max(0.0, budget) if math.isfinite(budget) else self._max_queue_wait_s

    def _timeout_error(self, name: str, deadline_unix_s: float = 0.0, requested: str = "") -> RouterError:
        if not self._registry.has_active_replica(name):  # says more than a missed deadline
            return self._starting(name, requested or name)
        if not self._registry.has_healthy_worker(name):  # says more than a missed deadline: retry later
            return RouterError(pb.ERROR_CODE_UNAVAILABLE, f"no healthy worker serves {name!r} now")
        if 0 < deadline_unix_s <= self._wall_clock():
            return RouterError(pb.ERROR_CODE_DEADLINE_EXCEEDED, "the request's deadline passed while it was queued")
        return RouterError(pb.ERROR_CODE_OVERLOADED, f"every worker serving {name!r} is busy")

    def _starting(self, name: str, requested: str) -> RouterError:
        """MODEL_STARTING; for a shared model whose load time is known, retry once its load should be done."""
        load_s = self.shared.expected_load_s(name)
        return _model_starting(requested, starting_retry_after_s(load_s) if load_s else COLD_START_RETRY_AFTER_S)


class _Candidates:
    """The workers a request for name@version may go to, per pool in headroom order: the version's token workers
    in rotation and healthy (from the registry's load index, read from the front) and the shared-pool workers
    holding it (few; their loads computed here)."""

    def __init__(self, registry: WorkerRegistry, name: str, version: str, shared: list[WorkerEntry]):
        self._registry = registry
        self._name, self._version = name, version
        self._shared = [registry.load_of(e) for e in shared]

    def in_order(self, pool: str, skip: frozenset[str], order: str = "headroom") -> Iterator[WorkerLoad]:
        registry = self._registry
        indexed = (load for entry, load in registry.loads.walk(GroupKey(self._name, self._version, pool, False), order)
                   if load.worker_id not in skip and registry.is_placeable(entry))
        if order != "headroom":
            return indexed
        shared = sorted((load for load in self._shared if load.pool == pool and load.worker_id not in skip),
                        key=headroom_key)
        return heapq.merge(indexed, shared, key=headroom_key) if shared else indexed

    def fewest_requests(self, pool: str, skip: frozenset[str]) -> int | None:
        """The fewest requests a candidate of the pool has (None: no candidate): the front of the requests order."""
        least = next(self.in_order(pool, skip, "requests"), None)
        counts = [load.num_requests for load in self._shared if load.pool == pool and load.worker_id not in skip]
        if least is not None:
            counts.append(least.num_requests)
        return min(counts, default=None)

    def any(self, skip: frozenset[str]) -> bool:
        """Some candidate is not in `skip`."""
        return any(next(self.in_order(pool, skip), None) is not None for pool in ("", LONG_CONTEXT_POOL))


def _model_starting(requested: str, retry_after_s: float = COLD_START_RETRY_AFTER_S, why: str = "") -> RouterError:
    """A cold model's answer: it names only what the caller asked for (the gateway passes it on as is)."""
    return RouterError(pb.ERROR_CODE_MODEL_STARTING, f"model {requested!r} is starting: "
                       f"{why or 'no replica is serving it yet'}; retry in {retry_after_s:g} s",
                       retry_after_s=retry_after_s)
