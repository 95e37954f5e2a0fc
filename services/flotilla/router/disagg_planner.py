"""Disaggregated placement on top of admission: admission chose a worker with room (role both or decode);
the planner picks the decode worker by prefix affinity within a load cap, then a prefill worker (queued
prefill tokens, prefix affinity) unless the uncached part of the prompt is short or no prefill worker serves
the model. With no prefill worker and one decode-capable worker it changes nothing (colocated fleets).
A retry is planned the same way, away from the workers it was lost on (`avoid`), a resumed stream included:
the prefill worker continues its seeds like the decode worker (GenerateRequest.num_previous_output_tokens).
Pools (context_pools.py): the plan stays in the pool of admission's choice, for the decode and the prefill worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.block_hash import hash_full_blocks
from flotilla.router.context_pools import LONG_CONTEXT_POOL
from flotilla.router.placement import (
    AffinityLimits,
    Candidate,
    PlacementLimits,
    can_admit,
    choose_decode_worker,
    choose_prefill_worker,
)
from flotilla.router.registry import WorkerEntry, WorkerRegistry

DEFAULT_BLOCK_SIZE = 16


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
        self._hash_sets: dict[str, tuple[float, frozenset[bytes]]] = {}  # worker id -> (heartbeat, hashes)
        self.num_prefix_hit_placements = 0  # placed on a worker holding part of the prompt

    def plan(self, chosen: WorkerEntry, request: pb.GenerateRequest, avoid: frozenset[str] = frozenset(),
             long_context: bool = False) -> Plan:
        """`avoid`: decode workers a retried request was lost on; admission chose `chosen` away from them.
        `long_context`: admission placed it as a long prompt (Placement.long_context)."""
        peers = [e for e in self._registry.healthy_workers(chosen.model_name, chosen.version)
                 if e.worker_id == chosen.worker_id
                 or (e.worker_id not in avoid and self._same_pool(chosen, e, long_context))]
        prefill_workers = [e for e in self._registry.healthy_prefill_workers(chosen.model_name, chosen.version)
                           if e.pool == chosen.pool]
        if len(peers) <= 1 and not prefill_workers:
            return Plan(chosen, None)
        prompt = list(request.prompt_token_ids)
        block_size = chosen.report.block_size or DEFAULT_BLOCK_SIZE
        hashes = hash_full_blocks(prompt, block_size, request.cache_salt)
        decode = self._pick_decode(chosen, peers, hashes, len(prompt))
        num_cached = self._num_cached(decode.load.worker_id, hashes)
        if num_cached:
            self.num_prefix_hit_placements += 1
        decode_entry = self._registry.get(decode.load.worker_id) or chosen
        if decode_entry is not chosen:  # admission counted the request on `chosen`: move it
            self._move_placement(chosen, decode_entry, len(prompt), long_context)
        if len(prompt) - num_cached * block_size < self.affinity.min_remote_prefill_tokens:
            return Plan(decode_entry, None)
        prefill = choose_prefill_worker(self._candidates(prefill_workers, hashes), self.affinity)
        if prefill is None:
            return Plan(decode_entry, None)
        prefill_entry = self._registry.get(prefill.load.worker_id)
        if prefill_entry is not None:
            self._registry.record_placement(prefill_entry, len(prompt))
        return Plan(decode_entry, prefill_entry)

    @staticmethod
    def _same_pool(chosen: WorkerEntry, peer: WorkerEntry, long_context: bool) -> bool:
        """A peer the plan may move the request to: same pool, and a short prompt lent to the long-context pool
        only moves to a long-context worker that runs no long prompt either."""
        return peer.pool == chosen.pool and (long_context or peer.pool != LONG_CONTEXT_POOL
                                             or peer.num_long_assigned == 0)

    def _pick_decode(self, chosen: WorkerEntry, peers: Sequence[WorkerEntry], hashes: list[bytes], num_tokens: int):
        candidates = [
            c for c in self._candidates(peers, hashes)
            if c.load.worker_id == chosen.worker_id or can_admit(c.load, num_tokens, self._limits)
        ]  # fmt: skip
        return choose_decode_worker(candidates, self.affinity)

    def _candidates(self, entries: Sequence[WorkerEntry], hashes: list[bytes]) -> list[Candidate]:
        return [Candidate(self._registry.load_of(e), self._num_cached(e.worker_id, hashes)) for e in entries]

    def _num_cached(self, worker_id: str, hashes: list[bytes]) -> int:
        cached = self._hash_set(worker_id)
        count = 0
        for block_hash in hashes:  # chained hashes: only a leading run can be hit
            if block_hash not in cached:
                break
            count += 1
        return count

    def _hash_set(self, worker_id: str) -> frozenset[bytes]:
        entry = self._registry.get(worker_id)
        if entry is None:
            return frozenset()
        memo = self._hash_sets.get(worker_id)
        if memo is None or memo[0] != entry.last_heartbeat:
            memo = self._hash_sets[worker_id] = (entry.last_heartbeat, frozenset(entry.report.cached_block_hashes))
        return memo[1]

    def _move_placement(self, old: WorkerEntry, new: WorkerEntry, num_tokens: int, long_context: bool) -> None:
        old.num_placed_requests = max(0, old.num_placed_requests - 1)
        old.num_placed_tokens = max(0, old.num_placed_tokens - num_tokens)
        old.num_assigned = max(0, old.num_assigned - 1)  # the relay releases the worker it really used
        new.num_assigned += 1
        if long_context:
            old.num_long_assigned = max(0, old.num_long_assigned - 1)
            new.num_long_assigned += 1
        self._registry.record_placement(new, num_tokens)

