"""Workers' placement loads kept in order, so that a placement reads the front of a list, not every candidate.

One group per (model, version, pool, prefill or not) of the token workers (shared-pool and fixed-batch workers
are not here). The registry puts a worker's load here each time something it depends on changes (registration,
a load report, a placement, a release, a placement the planner moved) and removes it on deregistration, so the
orders are always current; health and state, which change with the clock or outside the load, are checked by the
reader as it walks. Each group keeps the orders its readers need, every key ending in the worker id (unique, and
the deterministic tie-break placement has always used):
- decode-capable workers (role both or decode): by headroom (placement.headroom_key: admission's least-loaded
  choice) and by requests (fewest requests, then most free KV: the planner's least-loaded decode worker);
- prefill workers: by queued prefill tokens (the planner's least-loaded prefill worker).
Prefix affinity: per model version, block hash -> the workers whose last report lists it in their prefix cache,
so the workers holding a prompt's first block are found without looking at the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from sortedcontainers import SortedList

from flotilla.router.placement import WorkerLoad, headroom_key

if TYPE_CHECKING:
    from flotilla.router.registry import WorkerEntry


class GroupKey(NamedTuple):
    name: str
    version: str
    pool: str  # "" (default) or context_pools.LONG_CONTEXT_POOL
    prefill: bool  # prefill-only workers (they take no Generate of their own)


def requests_key(load: WorkerLoad) -> tuple:
    """The planner's decode order: fewest requests, then most free KV blocks."""
    return (load.num_requests, -load.num_free_blocks, load.worker_id)


def prefill_key(load: WorkerLoad) -> tuple:
    """The planner's prefill order: fewest queued prefill tokens."""
    return (load.num_queued_tokens, load.worker_id)


DECODE_ORDERS = {"headroom": headroom_key, "requests": requests_key}
PREFILL_ORDERS = {"queued": prefill_key}


class _Placed(NamedTuple):
    group: GroupKey
    entry: WorkerEntry
    load: WorkerLoad
    keys: dict[str, tuple]


class LoadIndex:
    def __init__(self) -> None:
        self._groups: dict[GroupKey, dict[str, SortedList]] = {}
        self._placed: dict[str, _Placed] = {}  # worker id -> where it is and under which keys
        self._cached: dict[tuple[str, str], dict[bytes, set[str]]] = {}  # (name, version) -> hash -> worker ids
        self._hashes: dict[str, frozenset[bytes]] = {}  # worker id -> its last reported prefix-cache hashes

    def put(self, group: GroupKey, entry: WorkerEntry, load: WorkerLoad) -> None:
        """Insert the worker, or move it to its new load's place."""
        old = self._placed.get(load.worker_id)
        if old is not None and old.group != group:
            self.remove(load.worker_id)
            old = None
        orders = self._groups.get(group)
        if orders is None:
            orders = self._groups[group] = {
                order: SortedList() for order in (PREFILL_ORDERS if group.prefill else DECODE_ORDERS)}
        keys = {}
        for order, key_of in (PREFILL_ORDERS if group.prefill else DECODE_ORDERS).items():
            key = keys[order] = key_of(load)
            if old is not None:
                if old.keys[order] == key:
                    continue
                orders[order].remove(old.keys[order])
            orders[order].add(key)
        self._placed[load.worker_id] = _Placed(group, entry, load, keys)

    def remove(self, worker_id: str) -> None:
        placed = self._placed.pop(worker_id, None)
        if placed is None:
            return
        orders = self._groups[placed.group]
        for order, key in placed.keys.items():
            orders[order].remove(key)
        if not next(iter(orders.values())):
            del self._groups[placed.group]
        self.set_cached(placed.group, worker_id, ())

    def load(self, worker_id: str) -> WorkerLoad | None:
        placed = self._placed.get(worker_id)
        return placed.load if placed is not None else None

    def group_of(self, worker_id: str) -> GroupKey | None:
        placed = self._placed.get(worker_id)
        return placed.group if placed is not None else None

    def walk(self, group: GroupKey, order: str) -> Iterator[tuple[WorkerEntry, WorkerLoad]]:
        """The group's workers with their loads, in `order` (see the module doc). Do not change loads while
        walking: the walk reads the live order."""
        orders = self._groups.get(group)
        if orders is None:
            return
        placed = self._placed
        for key in orders[order]:
            worker = placed[key[-1]]
            yield worker.entry, worker.load

    def is_empty(self, group: GroupKey) -> bool:
        return group not in self._groups

    # ---- prefix affinity -------------------------------------------------------------------------------------
    def set_cached(self, group: GroupKey, worker_id: str, block_hashes) -> None:
        """A worker's prefix cache as its last report lists it (chained block hashes)."""
        new = frozenset(block_hashes)
        old = self._hashes.get(worker_id, frozenset())
        if new == old:
            return
        by_hash = self._cached.setdefault((group.name, group.version), {})
        for block_hash in old - new:
            holders = by_hash.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del by_hash[block_hash]
        for block_hash in new - old:
            by_hash.setdefault(block_hash, set()).add(worker_id)
        if new:
            self._hashes[worker_id] = new
        else:
            self._hashes.pop(worker_id, None)
        if not by_hash:
            del self._cached[(group.name, group.version)]

    def has_cached(self, name: str, version: str) -> bool:
        """Some worker of the version reports a cached block."""
        return (name, version) in self._cached

    def holders(self, name: str, version: str, block_hash: bytes) -> set[str]:
        """Workers of the version whose prefix cache holds this block (do not modify the set)."""
        return self._cached.get((name, version), {}).get(block_hash, _EMPTY)

    def num_cached(self, worker_id: str, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt (its chained hashes) in the worker's prefix cache: only a leading run hits."""
        cached = self._hashes.get(worker_id)
        if not cached:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in cached:
                break
            count += 1
        return count


_EMPTY: set[str] = set()
