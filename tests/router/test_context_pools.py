"""The long-context pool: the pure policy (pool tiers, thresholds) and admission's use of it (lanes, lending,
release), with a registry of fake workers (no processes)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission
from flotilla.router.context_pools import LONG_CONTEXT_POOL, ContextThresholds, PoolRequest, pool_tiers
from flotilla.router.disagg_planner import DisaggPlanner
from flotilla.router.placement import PlacementLimits, WorkerLoad, choose_worker
from flotilla.router.registry import WorkerRegistry

LIMITS = PlacementLimits(32_768, 4, context=ContextThresholds({"tiny": 100}))


def load(worker_id, pool="", queued=0, requests=0, long_requests=0, max_model_len=0):
    return WorkerLoad(worker_id, queued, requests, 64, 64, pool, max_model_len, long_requests)


# ---- thresholds ----------------------------------------------------------------------------------------
def test_thresholds_parse_per_model_and_default():
    thresholds = ContextThresholds.parse(["tiny=100", "4096", "org/m=7"])
    assert thresholds.for_model("tiny") == 100 and thresholds.for_model("org/m") == 7
    assert thresholds.for_model("other") == 4096
    assert thresholds.is_long("tiny", 101) and not thresholds.is_long("tiny", 100)
    assert not ContextThresholds().is_long("tiny", 10**6)  # no threshold: no long prompts


@pytest.mark.parametrize("item", ["tiny=", "=5", "tiny=x", "tiny=0", "-1"])
def test_bad_thresholds_are_refused(item):
    with pytest.raises(ValueError):
        ContextThresholds.parse([item])


# ---- pool tiers ----------------------------------------------------------------------------------------
def test_long_prompts_go_only_to_the_long_pool():
    loads = [load("short"), load("long", LONG_CONTEXT_POOL, queued=30_000, requests=3)]
    assert choose_worker(loads, 500, LIMITS, pools=PoolRequest(long_context=True)) == "long"
    busy = [load("short"), load("long", LONG_CONTEXT_POOL, requests=4)]  # full: the long prompt waits
    assert choose_worker(busy, 500, LIMITS, pools=PoolRequest(long_context=True)) is None


def test_long_prompts_fall_back_to_default_workers_whose_window_holds_them():
    loads = [load("small-window", max_model_len=400), load("wide", queued=900, max_model_len=4096)]
    assert choose_worker(loads, 500, LIMITS, pools=PoolRequest(long_context=True)) == "wide"
    # None holds it: the default pool anyway (its worker answers with the context-length error at once).
    assert pool_tiers(loads[:1], 500, PoolRequest(long_context=True)) == [loads[:1]]


def test_short_prompts_prefer_the_default_pool_and_borrow_an_idle_long_worker():
    idle_long = load("long", LONG_CONTEXT_POOL)
    assert choose_worker([load("short", queued=900), idle_long], 10, LIMITS) == "short"  # more headroom elsewhere
    full = load("short", requests=4)
    assert choose_worker([full, idle_long], 10, LIMITS) == "long"
    running_long = load("long", LONG_CONTEXT_POOL, requests=1, long_requests=1)
    assert choose_worker([full, running_long], 10, LIMITS) is None
    assert choose_worker([full, idle_long], 10, LIMITS, pools=PoolRequest(long_waiting=True)) is None


def test_without_a_long_pool_placement_is_unchanged():
    loads = [load("a", queued=50), load("b")]
    assert pool_tiers(loads, 10, PoolRequest())[0] == loads
    assert choose_worker(loads, 10, LIMITS) == "b"


# ---- admission ------------------------------------------------------------------------------------------
def make():
    registry = WorkerRegistry(heartbeat_timeout_s=1e9, channel_factory=lambda address: grpc.aio.insecure_channel(address))
    return registry, Admission(registry, {}, ("tiny",), LIMITS, 8, 30.0)


def register(registry, worker_id, pool="", max_model_len=2048):
    model = pb.ModelInfo(name="tiny", version="v1", max_model_len=max_model_len)
    registry.register(rpb.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9", model=model, pool=pool))
    assert registry.heartbeat(worker_id, pb.LoadReport(num_free_blocks=64, num_total_blocks=64, block_size=16))


async def test_a_waiting_long_prompt_holds_up_no_short_one_and_closes_the_long_pool_to_them():
    registry, admission = make()
    register(registry, "short")
    register(registry, "long", LONG_CONTEXT_POOL)
    first = [await admission.acquire("tiny", 500) for _ in range(4)]  # fills the long worker
    assert {p.worker.worker_id for p in first} == {"long"} and all(p.long_context for p in first)
    waiting = asyncio.create_task(admission.acquire("tiny", 500))
    await asyncio.sleep(0)
    assert admission.queue_depth_by_pool()[("tiny", LONG_CONTEXT_POOL)] == 1
    short = [await admission.acquire("tiny", 10) for _ in range(4)]  # not queued behind the long one
    assert {p.worker.worker_id for p in short} == {"short"} and not any(p.long_context for p in short)
    registry.release(first[0].worker, long_context=True)
    admission.dispatch()
    assert (await waiting).worker.worker_id == "long"
    assert registry.get("long").num_long_assigned == 4


async def test_short_prompts_borrow_the_long_pool_only_while_it_runs_no_long_prompt():
    registry, admission = make()
    register(registry, "short")
    register(registry, "long", LONG_CONTEXT_POOL)
    long_one = await admission.acquire("tiny", 500)
    for _ in range(4):
        assert (await admission.acquire("tiny", 10)).worker.worker_id == "short"
    queued_short = asyncio.create_task(admission.acquire("tiny", 10))
    await asyncio.sleep(0)
    assert not queued_short.done()  # the default pool is full and the long worker is busy with a long prompt
    registry.release(long_one.worker, long_context=True)
    admission.dispatch()
    assert (await queued_short).worker.worker_id == "long"  # idle now: lent


async def test_without_a_long_worker_a_long_prompt_uses_a_default_worker_that_holds_it():
    registry, admission = make()
    register(registry, "narrow", max_model_len=256)
    register(registry, "wide", max_model_len=4096)
    placement = await admission.acquire("tiny", 500)
    assert placement.worker.worker_id == "wide" and placement.long_context
    assert registry.model_info("tiny", "v1").max_model_len == 4096  # the gateway admits what some worker holds


async def test_the_planner_keeps_a_long_prompt_in_its_pool():
    registry, admission = make()
    register(registry, "short")
    register(registry, "long", LONG_CONTEXT_POOL)
    placement = await admission.acquire("tiny", 500)
    request = pb.GenerateRequest(prompt_token_ids=list(range(500)))
    plan = DisaggPlanner(registry, LIMITS).plan(placement.worker, request, long_context=True)
    assert plan.decode.worker_id == "long" and plan.prefill is None


async def test_pool_metrics_count_waiters_workers_and_requests_by_pool():
    from prometheus_client import CollectorRegistry

    from flotilla.router.pool_metrics import PoolCollector

    registry, admission = make()
    register(registry, "short")
    register(registry, "long", LONG_CONTEXT_POOL)
    metrics = CollectorRegistry()
    metrics.register(PoolCollector(registry, admission))
    [await admission.acquire("tiny", 500) for _ in range(4)]
    await admission.acquire("tiny", 10)
    waiting = asyncio.create_task(admission.acquire("tiny", 500))
    await asyncio.sleep(0)
    value = metrics.get_sample_value
    assert value("flotilla_router_pool_queue_depth", {"model": "tiny", "pool": LONG_CONTEXT_POOL}) == 1
    assert value("flotilla_router_pool_workers", {"model": "tiny", "pool": "default"}) == 1
    labels = {"model": "tiny", "pool": LONG_CONTEXT_POOL, "prompt": "long"}
    assert value("flotilla_router_pool_inflight_requests", labels) == 4
    assert value("flotilla_router_pool_inflight_requests", {**labels, "pool": "default", "prompt": "short"}) == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
