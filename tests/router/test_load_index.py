"""The load index (router/load_index.py) agrees with a brute-force scan of the registry: under a fixed-seed random
sequence of registrations, re-registrations, deregistrations, load reports (prefix caches included), state and
health changes, placements, moved placements and releases, its orders are the registry's loads sorted, and the
decisions read from it (admission's worker, the planner's decode and prefill workers, the throughput samples)
are the ones the pre-index scans made over every candidate."""

from __future__ import annotations

import random

import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.engine.block_hash import hash_full_blocks
from flotilla.router.admission import Admission
from flotilla.router.context_pools import LONG_CONTEXT_POOL, ContextThresholds, PoolRequest
from flotilla.router import disagg_planner
from flotilla.router.disagg_planner import DEFAULT_BLOCK_SIZE, DisaggPlanner
from flotilla.router.load_index import DECODE_ORDERS, PREFILL_ORDERS, GroupKey
from flotilla.router.placement import (AffinityLimits, Candidate, PlacementLimits, WorkerLoad, can_admit,
                                       choose_decode_worker, choose_prefill_worker, choose_worker,
                                       choose_worker_in_order)
from flotilla.router.registry import WorkerRegistry
from flotilla.router.wait_estimate import ThroughputMeter

LIMITS = PlacementLimits(max_queued_tokens_per_worker=400, max_requests_per_worker=3, idle_tenant_extra_slots=1,
                         batch_min_free_kv_fraction=0.25, context=ContextThresholds({"m": 48}))
AFFINITY = AffinityLimits(max_decode_load_margin=1, max_prefill_token_margin=64, min_remote_prefill_tokens=16)
VERSIONS = ("v1", "v2")
ROLES = (pb.WORKER_ROLE_BOTH, pb.WORKER_ROLE_DECODE, pb.WORKER_ROLE_PREFILL)
# Prompts sharing leading blocks (16 tokens a block), so that prefix caches overlap in part.
PROMPTS = [[1] * 16 + [2] * 16, [1] * 16 + [3] * 16 + [4] * 16, [5] * 40, [1] * 16 + [2] * 16 + [6] * 30, [7] * 70]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _NoChannel:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _all_hashes() -> list[bytes]:
    return sorted({h for prompt in PROMPTS for h in hash_full_blocks(prompt, DEFAULT_BLOCK_SIZE, "")})


def _check_orders(registry: WorkerRegistry) -> None:
    groups: dict[GroupKey, list] = {}
    for entry in registry.workers():
        if not (entry.is_shared or entry.is_fixed_batch):
            groups.setdefault(registry.group_key(entry), []).append(registry.load_of(entry))
    for group, loads in groups.items():
        for order, key in (PREFILL_ORDERS if group.prefill else DECODE_ORDERS).items():
            walked = [load for _, load in registry.loads.walk(group, order)]
            assert walked == sorted(loads, key=key), (group, order)
    for name, version in {(g.name, g.version) for g in groups} | {("m", v) for v in VERSIONS}:
        for pool in ("", LONG_CONTEXT_POOL):
            for prefill in (False, True):
                if GroupKey(name, version, pool, prefill) not in groups:
                    assert registry.loads.is_empty(GroupKey(name, version, pool, prefill))


def _reference_choice(registry: WorkerRegistry, admission: Admission, version: str, num_tokens: int, tenant: str,
                      batch: bool, avoid: frozenset[str]) -> str | None:
    """Admission's choice before the index: every healthy candidate's load, then choose_worker."""
    healthy = registry.healthy_workers("m", version)
    workers = [e for e in healthy if e.worker_id not in avoid] or healthy
    pools = PoolRequest(LIMITS.context.is_long("m", num_tokens), admission._long_waiting("m"))
    return choose_worker([registry.load_of(e) for e in workers], num_tokens, LIMITS,
                         registry.num_assigned_to_tenant("m", tenant) == 0, batch=batch, pools=pools)


def _reference_plan(registry: WorkerRegistry, chosen, prompt: list[int], avoid: frozenset[str],
                    long_context: bool) -> tuple[str, str | None]:
    """The planner's choice before the index (without its bookkeeping): (decode worker, prefill worker or None)."""
    peers = [e for e in registry.healthy_workers(chosen.model_name, chosen.version)
             if e.worker_id == chosen.worker_id or (e.worker_id not in avoid
                                                    and DisaggPlanner._same_pool(chosen, e, long_context))]
    prefill_workers = [e for e in registry.healthy_prefill_workers(chosen.model_name, chosen.version)
                       if e.pool == chosen.pool]
    if len(peers) <= 1 and not prefill_workers:
        return chosen.worker_id, None
    hashes = hash_full_blocks(prompt, chosen.report.block_size or DEFAULT_BLOCK_SIZE, "")

    def cached(entry) -> int:
        held = set(entry.report.cached_block_hashes)
        return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))

    decode = choose_decode_worker([Candidate(registry.load_of(e), cached(e)) for e in peers
                                   if e is chosen or can_admit(registry.load_of(e), len(prompt), LIMITS)], AFFINITY)
    decode_entry = registry.get(decode.load.worker_id)
    if len(prompt) - cached(decode_entry) * DEFAULT_BLOCK_SIZE < AFFINITY.min_remote_prefill_tokens:
        return decode_entry.worker_id, None
    prefill = choose_prefill_worker([Candidate(registry.load_of(e), cached(e)) for e in prefill_workers], AFFINITY)
    return decode_entry.worker_id, prefill.load.worker_id if prefill is not None else None


def _random_report(rng: random.Random, totals: dict[str, int], worker_id: str, hashes: list[bytes]) -> pb.LoadReport:
    totals[worker_id] = totals.get(worker_id, 0) + rng.choice((0, 0, 50, 300))
    return pb.LoadReport(num_free_blocks=rng.randint(0, 16), num_total_blocks=16, block_size=DEFAULT_BLOCK_SIZE,
                         num_running=rng.randint(0, 3), num_waiting=rng.randint(0, 1),
                         num_queued_tokens=rng.choice((0, 0, 20, 150, 390)),
                         num_output_tokens_total=totals[worker_id],
                         cached_block_hashes=rng.sample(hashes, rng.randint(0, len(hashes))))


@pytest.mark.parametrize("scan_holders_up_to", [0, 1000], ids=["walk-the-order", "read-the-holders"])
def test_load_index_and_decisions_agree_with_a_brute_force_scan(monkeypatch, scan_holders_up_to):
    monkeypatch.setattr(disagg_planner, "SCAN_HOLDERS_UP_TO", scan_holders_up_to)  # both ways to the prefix choice
    rng = random.Random(20261201)
    clock = _Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=1.0, evict_after_s=1e9, clock=clock,
                              channel_factory=lambda address: _NoChannel())
    admission = Admission(registry, {}, ["m"], LIMITS, max_queue_depth=100, max_queue_wait_s=1.0)
    planner = DisaggPlanner(registry, LIMITS, AFFINITY)
    reference_meter = ThroughputMeter()
    hashes = _all_hashes()
    totals: dict[str, int] = {}
    placed: list[tuple] = []  # (entry, tenant, long flag) of assignments not released yet
    worker_ids = [f"w{i}" for i in range(14)]
    num_placed = num_moved = num_prefill = 0
    for step in range(1500):
        op = rng.random()
        worker_id = rng.choice(worker_ids)
        if op < 0.08 or registry.get(worker_id) is None and op < 0.3:
            registry.register(rpb.WorkerInfo(
                worker_id=worker_id, address=f"10.0.0.{rng.randint(1, 2)}:1", role=rng.choice(ROLES),
                pool=rng.choice(("", "default", LONG_CONTEXT_POOL)),
                model=pb.ModelInfo(name="m", version=rng.choice(VERSIONS), max_model_len=rng.choice((0, 40, 4096)))))
        elif op < 0.12:
            registry.deregister(worker_id)
        elif op < 0.4:
            registry.heartbeat(worker_id, _random_report(rng, totals, worker_id, hashes))
        elif op < 0.45:
            registry.set_state(worker_id, rng.choice((rpb.WORKER_STATE_ACTIVE,) * 3 + (rpb.WORKER_STATE_DRAINING,)))
        elif op < 0.48:
            registry.mark_failed(worker_id)
        elif op < 0.5:
            clock.now += rng.choice((0.3, 0.8))  # some reports go stale: those workers turn unhealthy
        elif op < 0.62 and placed:
            entry, tenant, long_context = placed.pop(rng.randrange(len(placed)))
            registry.release(entry, tenant, long_context, "m")
        else:
            prompt = rng.choice(PROMPTS)
            tenant = rng.choice(("a", "b", "c"))
            batch = rng.random() < 0.3
            version = rng.choice(VERSIONS)
            avoid = frozenset(rng.sample(worker_ids, rng.choice((0, 0, 1, 3))))
            if not any(ref.version == version for ref in registry.model_versions()):
                continue  # no worker of that version registered: admission answers MODEL_NOT_FOUND
            expected = _reference_choice(registry, admission, version, len(prompt), tenant, batch, avoid)
            priority = pb.PRIORITY_CLASS_BATCH if batch else pb.PRIORITY_CLASS_INTERACTIVE
            placement = admission._try_place(f"m@{version}", len(prompt), tenant, avoid, priority=priority)
            assert (placement.worker.worker_id if placement else None) == expected, step
            if placement is not None:
                num_placed += 1
                request = pb.GenerateRequest(request_id=f"r{step}", prompt_token_ids=prompt)
                expected_plan = _reference_plan(registry, placement.worker, prompt, avoid, placement.long_context)
                plan = planner.plan(placement.worker, request, avoid, placement.long_context)
                assert (plan.decode.worker_id, plan.prefill.worker_id if plan.prefill else None) == expected_plan, step
                num_moved += plan.decode is not placement.worker
                num_prefill += plan.prefill is not None
                placed.append((plan.decode, tenant, placement.long_context))
        for entry in registry.workers():  # the throughput samples as dispatch() took them before: every worker
            report = entry.report
            reference_meter.observe(entry.worker_id, report.num_output_tokens_total + report.num_prompt_tokens_total,
                                    report.num_running + report.num_waiting > 0, entry.last_heartbeat)
        admission._observe_throughput()
        assert admission.throughput._rates == reference_meter._rates, step
        _check_orders(registry)
    # The sequence exercised what it checks (fixed seed: these hold for this sequence).
    hits = planner.num_prefix_hit_placements
    assert num_placed > 100 and num_moved > 5 and num_prefill > 5 and hits > 20, (num_placed, num_moved, num_prefill,
                                                                                   hits)


def test_a_replaced_entry_leaves_the_index_and_its_release_does_not_come_back():
    registry = WorkerRegistry(channel_factory=lambda address: _NoChannel())
    info = rpb.WorkerInfo(worker_id="w", address="10.0.0.1:1", model=pb.ModelInfo(name="m", version="v1"))
    old = registry.register(info)
    registry.heartbeat("w", pb.LoadReport(num_total_blocks=8, num_free_blocks=8, block_size=16))
    registry.assign(old)
    info.model.version = "v2"
    new = registry.register(info)  # other weights: a new entry in another group
    registry.release(old)  # the old entry's stream ends after the re-registration
    assert registry.loads.is_empty(GroupKey("m", "v1", "", False))
    assert [entry for entry, _ in registry.loads.walk(GroupKey("m", "v2", "", False), "headroom")] == [new]
    registry.deregister("w")
    assert registry.loads.is_empty(GroupKey("m", "v2", "", False)) and registry.loads.load("w") is None


def test_a_saturated_pool_is_not_walked():
    """Every worker at the request cap: the answer (none) comes from the front of the requests order, not a walk."""
    limits = PlacementLimits(max_queued_tokens_per_worker=10_000, max_requests_per_worker=2)
    loads = [WorkerLoad(f"w{i}", num_queued_tokens=i, num_requests=2, num_free_blocks=8, num_total_blocks=8)
             for i in range(100)]
    read = []

    def ordered(pool: str):
        for load in loads if pool == "" else []:
            read.append(load.worker_id)
            yield load

    def fewest(pool: str):
        return min((load.num_requests for load in loads), default=None) if pool == "" else None

    assert choose_worker_in_order(ordered, 10, limits, fewest_requests=fewest) is None and read == []
    assert choose_worker_in_order(ordered, 10, limits) is None and len(read) == 100  # without the bound: all of them
    assert choose_worker(loads, 10, limits) is None
