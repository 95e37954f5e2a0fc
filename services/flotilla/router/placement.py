"""Placement policy, pure: which worker, if any, takes a request now. No gRPC, no clocks, no state.

The router calls it with the loads of the healthy workers that serve the request's resolved model version
(never a worker with other weights). A worker has room while its queued tokens (its last report plus what
the router placed there since) stay under a cap; among those with room, the most headroom wins: fewest
queued tokens, then most free KV blocks. Pools come first (context_pools.py): a long prompt is placed only
within the long-context pool's tier, a short one in the default pool's before any lent long-context worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from flotilla.router.context_pools import LONG_CONTEXT_POOL, ContextThresholds, PoolRequest, fits, pool_tiers


class WorkerLoad(NamedTuple):  # a tuple, not a frozen dataclass: built for every candidate of every placement
    worker_id: str
    num_queued_tokens: int  # known but not yet computed tokens, incl. prompts placed since the last report
    num_requests: int  # running + waiting, incl. requests placed since the last report
    num_free_blocks: int
    num_total_blocks: int
    pool: str = ""  # the worker's pool label ("": default; context_pools.LONG_CONTEXT_POOL)
    max_model_len: int = 0  # its context window (0: unknown)
    num_long_requests: int = 0  # long-prompt requests the router placed there whose relay has not ended


@dataclass(frozen=True)
class PlacementLimits:
    max_queued_tokens_per_worker: int = 32_768
    max_requests_per_worker: int = 64  # a full batch here; the router holds the rest (fairly) in its queues
    # Requests a worker may take above max_requests_per_worker for tenants with nothing in flight for the
    # model: a quiet tenant's request starts at once instead of waiting for a flooding tenant's to finish
    # (new flows first, as in FQ-CoDel). Bounded per worker, so many quiet tenants cannot overfill it.
    idle_tenant_extra_slots: int = 0
    # A batch-class request goes only to a worker with at least this share of its KV blocks free: the batch tier
    # fills spare memory and leaves a margin for interactive arrivals (0: no watermark).
    batch_min_free_kv_fraction: float = 0.0
    # Prompt length above which a request goes to the long-context pool, per model (context_pools.py).
    context: ContextThresholds = field(default_factory=ContextThresholds)

    def __post_init__(self) -> None:
        if self.max_queued_tokens_per_worker < 1 or self.max_requests_per_worker < 1:
            raise ValueError("placement limits must be >= 1")
        if self.idle_tenant_extra_slots < 0:
            raise ValueError("idle_tenant_extra_slots must be >= 0")
        if not 0.0 <= self.batch_min_free_kv_fraction < 1.0:
            raise ValueError("batch_min_free_kv_fraction must be in [0, 1)")


def can_admit(load: WorkerLoad, num_prompt_tokens: int, limits: PlacementLimits, idle_tenant: bool = False,
              batch: bool = False) -> bool:
    max_requests = limits.max_requests_per_worker + (limits.idle_tenant_extra_slots if idle_tenant else 0)
    if load.num_requests >= max_requests:
        return False
    if batch and load.num_free_blocks < limits.batch_min_free_kv_fraction * load.num_total_blocks:
        return False
    # A worker with nothing queued takes any prompt, however long: otherwise a long prompt would never run.
    if load.num_queued_tokens == 0:
        return True
    return load.num_queued_tokens + num_prompt_tokens <= limits.max_queued_tokens_per_worker


def headroom_key(load: WorkerLoad) -> tuple[int, int, int, str]:
    """Smaller is more headroom; the worker id breaks ties so that placement is deterministic."""
    return (load.num_queued_tokens, -load.num_free_blocks, load.num_requests, load.worker_id)


def choose_worker(loads: Iterable[WorkerLoad], num_prompt_tokens: int, limits: PlacementLimits,
                  idle_tenant: bool = False, batch: bool = False, pools: PoolRequest = PoolRequest()) -> str | None:
    """The id of the worker with the most headroom among those with room, or None when none has room.
    `idle_tenant`: the request's tenant has nothing in flight for the model (may use the extra slots);
    `batch`: a batch-class request (the free-KV watermark applies); `pools`: its pool tiers, tried in order."""
    for tier in pool_tiers(loads, num_prompt_tokens, pools):
        candidates = [load for load in tier if can_admit(load, num_prompt_tokens, limits, idle_tenant, batch)]
        if candidates:
            return min(candidates, key=headroom_key).worker_id
    return None


def choose_worker_in_order(ordered: Callable[[str], Iterable[WorkerLoad]], num_prompt_tokens: int,
                           limits: PlacementLimits, idle_tenant: bool = False, batch: bool = False,
                           pools: PoolRequest = PoolRequest(),
                           fewest_requests: Callable[[str], int | None] | None = None) -> str | None:
    """choose_worker's answer, from the candidates of each pool already in headroom_key order (`ordered(pool)`,
    pool "" or LONG_CONTEXT_POOL; the router's load index): it reads each pool from the front until a worker has
    room, instead of every candidate. The same tiers as pool_tiers, tried in the same order. `fewest_requests(pool)`:
    the fewest requests any candidate of the pool has (None: no candidate), so that a pool whose every worker is at
    the request cap (a saturated fleet, where dispatch() tries the queue's head on every report) is not walked."""
    max_requests = limits.max_requests_per_worker + (limits.idle_tenant_extra_slots if idle_tenant else 0)

    def first_with_room(loads: Iterable[WorkerLoad], pool: str) -> str | None:
        if fewest_requests is not None:
            fewest = fewest_requests(pool)
            if fewest is None or fewest >= max_requests:
                return None  # a bound for the tier's subsets too (the lent workers, those the prompt fits)
        for load in loads:
            if can_admit(load, num_prompt_tokens, limits, idle_tenant, batch):
                return load.worker_id
            queued = load.num_queued_tokens
            if 0 < queued and queued + num_prompt_tokens > limits.max_queued_tokens_per_worker:
                return None  # over the token cap: so is every later one (as many queued tokens or more)
        return None

    if pools.long_context:
        long_pool = iter(ordered(LONG_CONTEXT_POOL))
        first = next(long_pool, None)
        if first is not None:
            return first_with_room(_chain(first, long_pool), LONG_CONTEXT_POOL)
        seen_fitting = False

        def fitting() -> Iterator[WorkerLoad]:
            nonlocal seen_fitting
            for load in ordered(""):
                if fits(load, num_prompt_tokens):
                    seen_fitting = True
                    yield load

        chosen = first_with_room(fitting(), "")
        if chosen is not None or seen_fitting:
            return chosen
        return first_with_room(ordered(""), "")  # none fits: the default pool all the same (pool_tiers)
    chosen = first_with_room(ordered(""), "")
    if chosen is not None or pools.long_waiting:
        return chosen
    return first_with_room((load for load in ordered(LONG_CONTEXT_POOL) if load.num_long_requests == 0),
                           LONG_CONTEXT_POOL)


def _chain(first: WorkerLoad, rest: Iterator[WorkerLoad]) -> Iterator[WorkerLoad]:
    yield first
    yield from rest


# ---- disaggregation: prefix affinity with a load cap -----------------------------------------------------
@dataclass(frozen=True)
class AffinityLimits:
    """Prefer the worker holding the longest cached prefix unless its load is above the least-loaded
    candidate's by more than a margin: a shared system prompt must not send all traffic to one worker."""

    max_decode_load_margin: int = 4  # requests (running + waiting + placed) over the least-loaded decode worker
    max_prefill_token_margin: int = 4096  # queued tokens over the least-loaded prefill worker
    min_remote_prefill_tokens: int = 32  # a shorter uncached remainder is prefilled on the decode worker

    def __post_init__(self) -> None:
        if self.max_decode_load_margin < 0 or self.max_prefill_token_margin < 0 or self.min_remote_prefill_tokens < 1:
            raise ValueError("affinity margins must be >= 0 and min_remote_prefill_tokens >= 1")


class Candidate(NamedTuple):
    load: WorkerLoad
    num_cached_blocks: int  # leading blocks of the request's prompt in the worker's prefix cache


def choose_decode_worker(candidates: Iterable[Candidate], limits: AffinityLimits) -> Candidate | None:
    """Within the load cap: longest cached prefix, then fewest requests, then most free KV."""
    return _with_affinity(
        list(candidates),
        lambda c: c.load.num_requests,
        limits.max_decode_load_margin,
        lambda c: (-c.num_cached_blocks, c.load.num_requests, -c.load.num_free_blocks, c.load.worker_id),
    )


def choose_prefill_worker(candidates: Iterable[Candidate], limits: AffinityLimits) -> Candidate | None:
    """Within the load cap: longest cached prefix, then fewest queued prefill tokens."""
    return _with_affinity(
        list(candidates),
        lambda c: c.load.num_queued_tokens,
        limits.max_prefill_token_margin,
        lambda c: (-c.num_cached_blocks, c.load.num_queued_tokens, c.load.worker_id),
    )


def _with_affinity(candidates: list[Candidate], load, margin: int, key) -> Candidate | None:
    if not candidates:
        return None
    least = min(load(c) for c in candidates)
    return min((c for c in candidates if load(c) <= least + margin), key=key)
