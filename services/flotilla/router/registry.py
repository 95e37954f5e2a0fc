"""Workers known to the router: their model, address, last load report and health.

A worker is healthy while its heartbeats keep arriving (within `heartbeat_timeout_s`) and no call found it
unreachable since its last heartbeat. Its load for placement is its last report plus what the router placed
there since (reset by the next report, which then includes it).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.rpc.options import aio_channel
from flotilla.rpc.session_client import SessionClient
from flotilla.router.context_pools import DEFAULT_POOL, LONG_CONTEXT_POOL, pool_label
from flotilla.router.load_index import GroupKey, LoadIndex
from flotilla.router.model_assets import ModelAssetStore
from flotilla.router.models import ModelVersionRef
from flotilla.router.placement import WorkerLoad

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerEntry:
    info: rpb.WorkerInfo
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    registered_at: float
    last_heartbeat: float
    report: pb.LoadReport = field(default_factory=pb.LoadReport)
    num_placed_requests: int = 0  # since the last report
    num_placed_tokens: int = 0
    failed: bool = False  # a call found it unreachable; cleared by its next heartbeat
    num_inflight: int = 0  # streams relayed through its channel right now
    # Requests this router placed here whose relay has not ended. Exact and without the heartbeat's lag, so
    # a finished request frees its slot at once and the router, not the engine's FIFO queue, holds the
    # backlog (fair queueing between tenants happens in the router).
    num_assigned: int = 0
    num_released_since_report: int = 0  # relays ended since the last report (which may still count them)
    num_long_assigned: int = 0  # of num_assigned, those with a long prompt (context_pools.py), exact like it
    was_healthy: bool = True  # for logging health transitions once
    state: int = rpb.WORKER_STATE_ACTIVE  # warm and draining workers get no new work (autoscaler)
    state_since: float = 0.0  # when the state was set (or the worker registered): a drain's start
    # The certificate identity that registered this worker id: only it may heartbeat, re-register or
    # deregister the id while the router knows it ("" on an insecure router).
    owner: str = ""
    _session: SessionClient | None = None  # Generate streams multiplexed on one call (rpc/session_client.py)
    _batch_stub: worker_pb2_grpc.FixedBatchServiceStub | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def session(self) -> SessionClient:
        """The worker's generate session, opened on first use (and again after it broke)."""
        if self._session is None:
            self._session = SessionClient(self.stub.GenerateSession)
        return self._session

    @property
    def model_name(self) -> str:
        return self.info.model.name

    @property
    def pool(self) -> str:
        """Its pool label: "long-context", or "" for the default pool (which "default" also names)."""
        return "" if self.info.pool == DEFAULT_POOL else self.info.pool

    @property
    def is_fixed_batch(self) -> bool:
        """A fixed-batch worker (WorkerInfo.fixed_batch): RunBatch only, never a Generate stream."""
        return self.info.HasField("fixed_batch")

    @property
    def is_shared(self) -> bool:
        """A shared-pool worker (WorkerInfo.shared): no model of its own, loads any of its models on demand."""
        return self.info.HasField("shared")

    def has_loaded(self, qualified: str) -> bool:
        """Shared-pool worker: `name@version` is loaded there, as its last report (or load answer) says."""
        return qualified in self.report.loaded_models

    @property
    def batch_stub(self) -> worker_pb2_grpc.FixedBatchServiceStub:
        if self._batch_stub is None:
            self._batch_stub = worker_pb2_grpc.FixedBatchServiceStub(self.channel)
        return self._batch_stub

    @property
    def version(self) -> str:
        return self.info.model.version


class WorkerRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float = 1.0,
        evict_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        channel_factory: Callable[[str], grpc.aio.Channel] = aio_channel,
    ):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.evict_after_s = evict_after_s
        self._clock = clock
        self._channel_factory = channel_factory
        self._workers: dict[str, WorkerEntry] = {}
        # Indexes over _workers, kept on every membership change (register, deregister, eviction) so that a
        # placement reads only its model version's workers, not the whole fleet. An entry's model, version and
        # kind never change (a re-registration makes a new entry); state and health are read at placement.
        self._kinds: dict[str, dict[str, WorkerEntry]] = {"token": {}, "shared": {}, "fixed_batch": {}}
        self._token_by_version: dict[tuple[str, str], dict[str, WorkerEntry]] = {}  # token workers of a version
        self._token_by_name: dict[str, dict[str, WorkerEntry]] = {}
        self._first_registered: dict[tuple[str, str], float] = {}  # (name, version) -> earliest registered_at
        self._tenant_assigned: Counter[tuple[str, str]] = Counter()  # (model name, tenant) -> requests placed
        # Token workers' loads in placement order, kept on every change of a load (load_index.py).
        self.loads = LoadIndex()
        # Workers with a report (or a registration) since admission last read them (take_reported).
        self._reported: dict[str, WorkerEntry] = {}
        # Replaced or removed workers whose channels sweep() closes once their relayed streams ended
        # (a worker that deregisters to drain still finishes its streams).
        self._closing: list[WorkerEntry] = []
        # States set (SetWorkerState) for workers not registered yet: worker id -> (state, set at).
        self._pending_states: dict[str, tuple[int, float]] = {}
        # Tokenizer files of the models registered workers serve, for gateways (model_assets.py).
        self.assets = ModelAssetStore()

    # ---- membership --------------------------------------------------------------------------------
    def register(self, info: rpb.WorkerInfo, owner: str = "") -> WorkerEntry:
        """Add a worker, or replace one with the same id (a restart may bring other weights or a port).
        The caller has checked that `owner` may (owner_of)."""
        old = self._workers.get(info.worker_id)
        now = self._clock()
        if old is not None and old.info.address == info.address:
            channel, stub = old.channel, old.stub
        else:
            if old is not None:
                self._closing.append(old)
            channel = self._channel_factory(info.address)
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
        entry = WorkerEntry(rpb.WorkerInfo(), channel, stub, registered_at=now, last_heartbeat=now, owner=owner)
        entry.info.CopyFrom(info)
        if old is not None and old.channel is channel:
            entry.num_inflight = old.num_inflight
            entry._session = old._session  # same channel, same session: its streams go on
        if old is not None:
            entry.num_assigned = old.num_assigned
            entry.num_long_assigned = old.num_long_assigned
        pending = self._pending_states.pop(info.worker_id, None)
        entry.state_since = now
        if old is not None:
            entry.state, entry.state_since = old.state, old.state_since
        elif pending is not None:
            entry.state = pending[0]
        self._workers[info.worker_id] = entry
        self._index(entry, old)
        self._reported[entry.worker_id] = entry
        self.loads.remove(entry.worker_id)  # its kind, version or pool may have changed; its cache is unknown
        self._refresh(entry)
        if old is not None:
            self.assets.retain(self.announced_assets())
        served = (f"shared pool of {', '.join(m.name for m in info.shared.models)}" if entry.is_shared
                  else f"{entry.model_name}@{entry.version}")
        logger.info("worker %s registered: %s at %s (%s pool)", info.worker_id, served, info.address,
                    pool_label(entry.pool))
        return entry

    def owner_of(self, worker_id: str) -> str | None:
        """The identity bound to a known worker id; None for an id the router does not know."""
        entry = self._workers.get(worker_id)
        return entry.owner if entry is not None else None

    def heartbeat(self, worker_id: str, report: pb.LoadReport) -> bool:
        """Record a load report; False when the worker is unknown (it must register again)."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return False
        entry.report.CopyFrom(report)
        entry.last_heartbeat = self._clock()
        entry.num_placed_requests = entry.num_placed_tokens = entry.num_released_since_report = 0
        entry.failed = False
        self._reported[worker_id] = entry
        group = self._refresh(entry)
        if group is not None:
            self.loads.set_cached(group, worker_id, report.cached_block_hashes)
        return True

    def take_reported(self) -> list[WorkerEntry]:
        """Workers registered or reporting since the last call, each once (its latest entry): what changed. One
        reader: the router's admission (its throughput meter)."""
        reported, self._reported = list(self._reported.values()), {}
        return reported

    def deregister(self, worker_id: str) -> bool:
        entry = self._workers.pop(worker_id, None)
        if entry is None:
            return False
        self._unindex(entry)
        self.loads.remove(worker_id)
        self._reported.pop(worker_id, None)
        self._closing.append(entry)
        self.assets.retain(self.announced_assets())
        logger.info("worker %s deregistered", worker_id)
        return True

    # ---- membership indexes (a bucket is a dict worker id -> entry, in registration order) -----------
    def _buckets(self, entry: WorkerEntry) -> list[tuple[dict, object]]:
        """The (index, key) pairs whose bucket holds this entry."""
        if entry.is_shared:
            return [(self._kinds, "shared")]
        if entry.is_fixed_batch:
            return [(self._kinds, "fixed_batch")]
        return [(self._kinds, "token"), (self._token_by_version, (entry.model_name, entry.version)),
                (self._token_by_name, entry.model_name)]

    def _index(self, entry: WorkerEntry, old: WorkerEntry | None) -> None:
        """Put a (re-)registered entry in its buckets; a replaced one keeps its place where its buckets stay."""
        if old is not None and [k for _, k in self._buckets(old)] != [k for _, k in self._buckets(entry)]:
            self._unindex(old)
        for index, key in self._buckets(entry):
            index.setdefault(key, {})[entry.worker_id] = entry
        key = (entry.model_name, entry.version)
        if old is None and key in self._first_registered and not (entry.is_shared or entry.is_fixed_batch):
            # a new token worker of a known version: no scan
            self._first_registered[key] = min(self._first_registered[key], entry.registered_at)
        else:
            self._refresh_first_registered(entry)

    def _unindex(self, entry: WorkerEntry) -> None:
        for index, key in self._buckets(entry):
            bucket = index.get(key, {})
            bucket.pop(entry.worker_id, None)
            if not bucket and index is not self._kinds:
                index.pop(key, None)
        self._refresh_first_registered(entry)

    @staticmethod
    def group_key(entry: WorkerEntry) -> GroupKey:
        """Its group in the load index (token workers only)."""
        return GroupKey(entry.model_name, entry.version, entry.pool, entry.info.role == pb.WORKER_ROLE_PREFILL)

    def _refresh(self, entry: WorkerEntry) -> GroupKey | None:
        """Put a registered token worker's current load in the load index; its group, or None."""
        if entry.is_shared or entry.is_fixed_batch or self._workers.get(entry.worker_id) is not entry:
            return None  # not indexed, or a replaced entry whose streams are ending
        group = self.loads.group_of(entry.worker_id) or self.group_key(entry)  # register() removed a replaced one
        self.loads.put(group, entry, self.load_of(entry))
        return group

    def _refresh_first_registered(self, entry: WorkerEntry) -> None:
        if entry.is_shared or entry.is_fixed_batch:
            return
        key = (entry.model_name, entry.version)
        group = self._token_by_version.get(key)
        if group:
            self._first_registered[key] = min(e.registered_at for e in group.values())
        else:
            self._first_registered.pop(key, None)

    def set_state(self, worker_id: str, state: int) -> tuple[bool, int]:
        """Put a worker in or out of rotation; (registered, previous state). For an unknown id the state is
        kept until it registers (evicted with it after evict_after_s)."""
        entry = self._workers.get(worker_id)
        if entry is None:
            previous = self._pending_states.get(worker_id, (rpb.WORKER_STATE_UNSPECIFIED, 0.0))[0]
            self._pending_states[worker_id] = (state, self._clock())
            return False, previous
        previous, entry.state = entry.state, state
        if previous != state:
            entry.state_since = self._clock()
            logger.info("worker %s: %s -> %s", worker_id, rpb.WorkerState.Name(previous), rpb.WorkerState.Name(state))
        return True, previous

    def announced_assets(self) -> set[str]:
        """Digests of the tokenizer files registered workers serve."""
        return {m.assets_digest for e in self._workers.values() for m in _models_of(e) if m.assets_digest}

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[WorkerEntry]:
        return list(self._workers.values())

    # ---- health ------------------------------------------------------------------------------------
    def is_healthy(self, entry: WorkerEntry) -> bool:
        # A worker whose output check failed is up and heartbeating, but its answers are wrong.
        return (not entry.failed and not entry.report.output_check_failure
                and self._clock() - entry.last_heartbeat <= self.heartbeat_timeout_s)

    def mark_failed(self, worker_id: str) -> None:
        entry = self._workers.get(worker_id)
        if entry is not None and not entry.failed:
            entry.failed = True
            logger.warning("worker %s unreachable: no new work until its next heartbeat", worker_id)

    async def sweep(self) -> None:
        """Log health transitions, evict workers silent for evict_after_s, close channels no longer used."""
        now = self._clock()
        for entry in list(self._workers.values()):
            healthy = self.is_healthy(entry)
            if healthy != entry.was_healthy:
                entry.was_healthy = healthy
                why = f" ({entry.report.output_check_failure})" if entry.report.output_check_failure else ""
                logger.warning("worker %s is %s%s", entry.worker_id, "healthy again" if healthy else "unhealthy", why)
            if now - entry.last_heartbeat > self.evict_after_s:
                self.deregister(entry.worker_id)
        self._pending_states = {
            worker_id: pending for worker_id, pending in self._pending_states.items()
            if now - pending[1] <= self.evict_after_s
        }
        idle = [entry for entry in self._closing if entry.num_inflight == 0]
        self._closing = [entry for entry in self._closing if entry.num_inflight > 0]
        for entry in idle:
            await entry.channel.close()

    async def close(self) -> None:
        for worker_id in list(self._workers):
            self.deregister(worker_id)
        for entry in self._closing:
            await entry.channel.close()
        self._closing = []

    # ---- placement inputs --------------------------------------------------------------------------
    def healthy_workers(self, name: str, version: str) -> list[WorkerEntry]:
        """Workers that can run a whole request (role both or decode): prefill-only workers take no Generate."""
        return [
            e for e in self._all_healthy(name, version) if e.info.role != pb.WORKER_ROLE_PREFILL
        ]

    def healthy_prefill_workers(self, name: str, version: str) -> list[WorkerEntry]:
        return [e for e in self._all_healthy(name, version) if e.info.role == pb.WORKER_ROLE_PREFILL]

    def _all_healthy(self, name: str, version: str) -> list[WorkerEntry]:
        return [
            e for e in self._token_by_version.get((name, version), {}).values()
            if e.state == rpb.WORKER_STATE_ACTIVE and self.is_healthy(e)
        ]

    def has_healthy_worker(self, name: str) -> bool:
        return any(self.is_healthy(e) for e in self._token_by_name.get(name, {}).values()) or any(
            self.is_healthy(e) and any(m.name == name for m in e.info.shared.models) for e in self.shared_workers())

    def has_active_replica(self, name: str) -> bool:
        """A worker in rotation is registered for this model, healthy or not; without one the model is cold
        (its pool scaling from zero, or only warm replicas not promoted yet). A shared-pool worker counts while
        it holds the model loaded: until then the model is cold too (its load is its cold start)."""
        return any(e.state == rpb.WORKER_STATE_ACTIVE for e in self._token_by_name.get(name, {}).values()) or any(
            e.state == rpb.WORKER_STATE_ACTIVE and any(m.partition("@")[0] == name for m in e.report.loaded_models)
            for e in self.shared_workers())

    def _token_workers(self) -> list[WorkerEntry]:
        """Workers of one model on the token path (Generate); fixed-batch workers are the batch dispatcher's,
        shared-pool workers the shared pool's (shared_pool.py)."""
        return list(self._kinds["token"].values())

    def shared_workers(self) -> list[WorkerEntry]:
        """Shared-pool workers, in any state and health."""
        return list(self._kinds["shared"].values())

    def fixed_batch_workers(self, name: str) -> list[WorkerEntry]:
        """Fixed-batch workers of a model, in any state and health (the dispatcher filters)."""
        return [e for e in self._kinds["fixed_batch"].values() if e.model_name == name]

    def can_take_batch(self, entry: WorkerEntry) -> bool:
        return self.is_healthy(entry) and entry.state == rpb.WORKER_STATE_ACTIVE

    def is_placeable(self, entry: WorkerEntry) -> bool:
        """In rotation and healthy: what the load index's readers check as they walk."""
        return entry.state == rpb.WORKER_STATE_ACTIVE and self.is_healthy(entry)

    def has_long_context_workers(self, name: str) -> bool:
        """A long-context token worker of the model is registered, in any state and health."""
        return any(not self.loads.is_empty(GroupKey(name, version, LONG_CONTEXT_POOL, prefill))
                   for (model, version) in self._first_registered if model == name for prefill in (False, True)
                   ) or any(e.pool == LONG_CONTEXT_POOL for e in self.fixed_batch_workers(name))

    def token_workers_of(self, name: str) -> list[WorkerEntry]:
        """Token workers of the model (any version, state and health)."""
        return list(self._token_by_name.get(name, {}).values())

    def record_placement(self, entry: WorkerEntry, num_prompt_tokens: int, refresh: bool = True) -> None:
        entry.num_placed_requests += 1
        entry.num_placed_tokens += num_prompt_tokens
        if refresh:
            self._refresh(entry)

    def place(self, entry: WorkerEntry, num_prompt_tokens: int, tenant: str = "", long_context: bool = False,
              model: str = "") -> None:
        """record_placement and assign at once (admission's placement): one update of the load index."""
        self.record_placement(entry, num_prompt_tokens, refresh=False)
        self.assign(entry, tenant, long_context, model)

    def move_placement(self, old: WorkerEntry, new: WorkerEntry, num_tokens: int, long_context: bool) -> None:
        """A placement admission counted on `old` goes to `new` instead (the planner's prefix affinity)."""
        old.num_placed_requests = max(0, old.num_placed_requests - 1)
        old.num_placed_tokens = max(0, old.num_placed_tokens - num_tokens)
        old.num_assigned = max(0, old.num_assigned - 1)  # the relay releases the worker it really used
        new.num_assigned += 1
        if long_context:
            old.num_long_assigned = max(0, old.num_long_assigned - 1)
            new.num_long_assigned += 1
        self._refresh(old)
        self.record_placement(new, num_tokens)

    def assign(self, entry: WorkerEntry, tenant: str = "", long_context: bool = False, model: str = "") -> None:
        """`long_context`: a long prompt (context_pools.py); `model`: the request's model name (default: the
        worker's; a shared-pool worker has none). Release it with the same arguments."""
        entry.num_assigned += 1
        entry.num_long_assigned += long_context
        self._tenant_assigned[(model or entry.model_name, tenant)] += 1
        self._refresh(entry)

    def release(self, entry: WorkerEntry, tenant: str = "", long_context: bool = False, model: str = "") -> None:
        entry.num_assigned = max(0, entry.num_assigned - 1)
        if long_context:
            entry.num_long_assigned = max(0, entry.num_long_assigned - 1)
        entry.num_released_since_report += 1
        key = (model or entry.model_name, tenant)
        if self._tenant_assigned[key] <= 1:
            del self._tenant_assigned[key]
        else:
            self._tenant_assigned[key] -= 1
        self._refresh(entry)

    def num_assigned_to_tenant(self, model_name: str, tenant: str) -> int:
        """Requests of this tenant the router placed for this model whose relay has not ended (any worker)."""
        return self._tenant_assigned.get((model_name, tenant), 0)

    def load_of(self, entry: WorkerEntry) -> WorkerLoad:
        report = entry.report
        block_size = report.block_size or 1
        num_placed_blocks = math.ceil(entry.num_placed_tokens / block_size)
        # The report lags: it may still count requests that ended since (subtract them) and may not yet count
        # requests on their way there (num_assigned covers those, and requests of other routers are reported).
        reported = report.num_running + report.num_waiting + entry.num_placed_requests - entry.num_released_since_report
        return WorkerLoad(
            worker_id=entry.worker_id,
            num_queued_tokens=report.num_queued_tokens + entry.num_placed_tokens,
            num_requests=max(entry.num_assigned, reported),
            num_free_blocks=max(0, report.num_free_blocks - num_placed_blocks),
            num_total_blocks=report.num_total_blocks,
            pool=entry.pool,
            max_model_len=entry.info.model.max_model_len,
            num_long_requests=entry.num_long_assigned,
        )

    def model_versions(self) -> list[ModelVersionRef]:
        refs: dict[tuple[str, str], ModelVersionRef] = {
            key: ModelVersionRef(key[0], key[1], self._first_registered[key], any(map(self.is_healthy, entries.values())))
            for key, entries in self._token_by_version.items()
        }  # in the order of each version's first worker in _workers, as a scan of the workers would give
        for entry in self._kinds["shared"].values():  # every model a shared-pool worker can load is served
            for model in entry.info.shared.models:
                old = refs.get((model.name, model.version))
                healthy = self.is_healthy(entry) or (old is not None and old.has_healthy_worker)
                first = min(entry.registered_at, old.first_registered) if old is not None else entry.registered_at
                refs[(model.name, model.version)] = ModelVersionRef(model.name, model.version, first, healthy)
        return list(refs.values())

    def model_info(self, name: str, version: str) -> pb.ModelInfo | None:
        """The version's model info, with the widest context window among its workers: a long-context pool may
        hold prompts the default pool cannot (placement sends each prompt only where it fits)."""
        infos = [model for entry in [*self._token_by_version.get((name, version), {}).values(), *self._kinds["shared"].values()]
                 for model in _models_of(entry) if model.name == name and model.version == version]
        return max(infos, key=lambda info: info.max_model_len) if infos else None

    def status(self, entry: WorkerEntry) -> rpb.WorkerStatus:
        """What ListWorkers shows: the load without request ids or prefix-cache hashes (what requests run and
        which prompts were seen are the router's to know, not its callers')."""
        load = pb.LoadReport()
        load.CopyFrom(entry.report)
        load.ClearField("active_request_ids")
        load.ClearField("cached_block_hashes")
        return rpb.WorkerStatus(
            worker=entry.info,
            healthy=self.is_healthy(entry),
            load=load,
            seconds_since_heartbeat=self._clock() - entry.last_heartbeat,
            state=entry.state,
            num_inflight=entry.num_inflight,
            seconds_in_state=self._clock() - entry.state_since,
        )


def _models_of(entry: WorkerEntry) -> list[pb.ModelInfo]:
    """The models a worker serves: its own, or a shared-pool worker's loadable ones."""
    return list(entry.info.shared.models) if entry.is_shared else [entry.info.model]
