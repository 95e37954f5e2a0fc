"""Disaggregated placement on top of admission: admission chose a worker with room (role both or decode);
the planner picks the decode worker by prefix affinity within a load cap, then a prefill worker (queued
prefill tokens, prefix affinity) unless the uncached part of the prompt is short or no prefill worker serves
the model. With no prefill worker and one decode-capable worker it changes nothing (colocated fleets).
A retry is planned the same way, away from the workers it was lost on (`avoid`), a resumed stream included:
the prefill worker continues its seeds like the decode worker (GenerateRequest.num_previous_output_tokens).
Pools (context_pools.py): the plan stays in the pool of admission's choice, for the decode and the prefill worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.block_hash import hash_full_blocks
from flotilla.router.context_pools import LONG_CONTEXT_POOL
from flotilla.router.load_index import DECODE_ORDERS, PREFILL_ORDERS, GroupKey
from flotilla.router.placement import AffinityLimits, PlacementLimits, WorkerLoad, can_admit
from flotilla.router.registry import WorkerEntry, WorkerRegistry

DEFAULT_BLOCK_SIZE = 16
SCAN_HOLDERS_UP_TO = 32  # a block's holders read one by one up to this many; more: walk the load order instead


class Plan(NamedTuple):
    decode: WorkerEntry
    prefill: WorkerEntry | None  # None: the decode worker prefills itself

    @property
    def prefill_worker_address(self) -> str:
        """GenerateRequest.prefill_worker_address for the decode worker."""
        return self.prefill.info.address if self.prefill is not None else ""


class DisaggPlanner:
    def __init__(self, registry: WorkerRegistry, limits: PlacementLimits | None = None,
                 affinity: AffinityLimits | None = None):  # fmt: skip
        self._registry = registry
        self._limits = limits or PlacementLimits()
        self.affinity = affinity or AffinityLimits()
        self.num_prefix_hit_placements = 0  # placed on a worker holding part of the prompt

    def plan(self, chosen: WorkerEntry, request: pb.GenerateRequest, avoid: frozenset[str] = frozenset(),
             long_context: bool = False) -> Plan:
        """`avoid`: decode workers a retried request was lost on; admission chose `chosen` away from them.
        `long_context`: admission placed it as a long prompt (Placement.long_context).

        Candidates come from the registry's load index (load_index.py), least loaded first, and the prefix
        index: the choice is choose_decode_worker's and choose_prefill_worker's over every candidate, read
        from the front of the orders and from the workers holding the prompt's first block."""
        registry = self._registry
        group = registry.loads.group_of(chosen.worker_id)
        if group is None or group.prefill:  # a shared-pool worker (not in the index): no peers, no prefill
            return Plan(chosen, None)
        prefill_group = group._replace(prefill=True)

        def is_peer(entry: WorkerEntry) -> bool:
            return entry is chosen or (entry.worker_id not in avoid and registry.is_placeable(entry)
                                       and self._same_pool(chosen, entry, long_context))

        has_prefill = any(registry.is_placeable(e) for e, _ in registry.loads.walk(prefill_group, "queued"))
        if not has_prefill and sum(1 for _ in zip(range(2), self._walk(group, "requests", is_peer))) <= 1:
            return Plan(chosen, None)
        prompt = list(request.prompt_token_ids)
        block_size = chosen.report.block_size or DEFAULT_BLOCK_SIZE
        # No worker of the version reports a cached block: no prefix can hit, so no need to hash the prompt.
        hashes = (hash_full_blocks(prompt, block_size, request.cache_salt)
                  if registry.loads.has_cached(group.name, group.version) else [])
        decode_entry = self._pick_decode(chosen, group, is_peer, hashes, len(prompt))
        num_cached = registry.loads.num_cached(decode_entry.worker_id, hashes)
        if num_cached:
            self.num_prefix_hit_placements += 1
        if decode_entry is not chosen:  # admission counted the request on `chosen`: move it
            registry.move_placement(chosen, decode_entry, len(prompt), long_context)
        if len(prompt) - num_cached * block_size < self.affinity.min_remote_prefill_tokens:
            return Plan(decode_entry, None)
        prefill_entry = self._pick_prefill(prefill_group, hashes)
        if prefill_entry is None:
            return Plan(decode_entry, None)
        registry.record_placement(prefill_entry, len(prompt))
        return Plan(decode_entry, prefill_entry)

    @staticmethod
    def _same_pool(chosen: WorkerEntry, peer: WorkerEntry, long_context: bool) -> bool:
        """A peer the plan may move the request to: same pool, and a short prompt lent to the long-context pool
        only moves to a long-context worker that runs no long prompt either."""
        return peer.pool == chosen.pool and (long_context or peer.pool != LONG_CONTEXT_POOL
                                             or peer.num_long_assigned == 0)

    def _walk(self, group: GroupKey, order: str, accept) -> Iterator[tuple[WorkerEntry, WorkerLoad]]:
        return ((entry, load) for entry, load in self._registry.loads.walk(group, order) if accept(entry))

    def _pick_decode(self, chosen: WorkerEntry, group: GroupKey, is_peer, hashes: list[bytes],
                     num_tokens: int) -> WorkerEntry:
        """choose_decode_worker over the peers with room (and `chosen`): the least-loaded one is the front of the
        requests order; one with a cached prefix within the load margin is found from the prefix index."""

        def is_candidate(entry: WorkerEntry) -> bool:
            if not is_peer(entry):
                return False
            return entry is chosen or can_admit(self._registry.loads.load(entry.worker_id), num_tokens, self._limits)

        least = next(self._walk(group, "requests", is_candidate), None)
        if least is None:
            return chosen
        best = self._with_prefix(group, "requests", hashes, is_candidate, lambda load: load.num_requests,
                                 least[1].num_requests + self.affinity.max_decode_load_margin)
        return best if best is not None else least[0]

    def _pick_prefill(self, group: GroupKey, hashes: list[bytes]) -> WorkerEntry | None:
        """choose_prefill_worker over the version's prefill workers of the pool, as _pick_decode reads them."""
        placeable = self._registry.is_placeable
        least = next(self._walk(group, "queued", placeable), None)
        if least is None:
            return None
        best = self._with_prefix(group, "queued", hashes, placeable, lambda load: load.num_queued_tokens,
                                 least[1].num_queued_tokens + self.affinity.max_prefill_token_margin)
        return best if best is not None else least[0]

    def _with_prefix(self, group: GroupKey, order: str, hashes: list[bytes], accept, load_of_interest,
                     limit: int) -> WorkerEntry | None:
        """The accepted worker within the load cap (`load_of_interest` <= `limit`) holding the longest cached prefix
        of the prompt, ties broken by `order` (whose key is the choice's tie-break); None when none holds its first
        block. Deepest block first: the first depth with such a worker is the longest prefix. A depth's holders
        are read directly when few; when many (a system prompt every worker caches), the order is walked from the
        front until the first holder, which is then the least loaded of them."""
        loads = self._registry.loads
        key_of = (PREFILL_ORDERS if group.prefill else DECODE_ORDERS)[order]
        for depth in range(len(hashes), 0, -1):
            holders = loads.holders(group.name, group.version, hashes[depth - 1])
            if not holders:
                continue
            prefix = hashes[:depth]
            if len(holders) <= SCAN_HOLDERS_UP_TO:
                best, best_key = None, None
                for worker_id in holders:
                    load = loads.load(worker_id)
                    if (loads.group_of(worker_id) != group or load_of_interest(load) > limit
                            or loads.num_cached(worker_id, prefix) < depth):
                        continue
                    entry = self._registry.get(worker_id)
                    if accept(entry) and (best_key is None or key_of(load) < best_key):
                        best, best_key = entry, key_of(load)
                if best is not None:
                    return best
                continue
            for entry, load in loads.walk(group, order):
                if load_of_interest(load) > limit:
                    break  # in this order every later one is above the cap too
                if load.worker_id in holders and loads.num_cached(load.worker_id, prefix) == depth and accept(entry):
                    return entry
        return None
