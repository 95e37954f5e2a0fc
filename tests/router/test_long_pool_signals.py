"""GetPoolSignals for one pool: the long-context pool's workers and its own queue lane, apart from the default
pool's, so that the autoscaler scales each from its own load (no processes: a registry of fake workers)."""

from __future__ import annotations

import asyncio

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission
from flotilla.router.context_pools import DEFAULT_POOL, LONG_CONTEXT_POOL, ContextThresholds
from flotilla.router.placement import PlacementLimits
from flotilla.router.pool_signals import pool_signals
from flotilla.router.registry import WorkerRegistry
from flotilla.router.traffic import TrafficWindow

LIMITS = PlacementLimits(32_768, 4, context=ContextThresholds({"tiny": 100}))


def register(registry, worker_id, pool, free, queued):
    model = pb.ModelInfo(name="tiny", version="v1", max_model_len=2048)
    registry.register(rpb.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9", model=model, pool=pool))
    load = pb.LoadReport(num_free_blocks=free, num_total_blocks=64, block_size=16, num_queued_tokens=queued)
    assert registry.heartbeat(worker_id, load)


async def test_a_pools_signals_are_its_workers_and_its_lane():
    registry = WorkerRegistry(heartbeat_timeout_s=1e9, channel_factory=lambda a: grpc.aio.insecure_channel(a))
    admission = Admission(registry, {}, ("tiny",), LIMITS, 8, 30.0)
    register(registry, "short", "", free=60, queued=7)
    register(registry, "long", LONG_CONTEXT_POOL, free=16, queued=300)
    placed = [await admission.acquire("tiny", 500) for _ in range(4)] + \
             [await admission.acquire("tiny", 10) for _ in range(4)]  # both workers full
    assert {p.worker.worker_id for p in placed} == {"short", "long"}
    waiting = [asyncio.create_task(admission.acquire("tiny", n)) for n in (500, 600, 10)]
    await asyncio.sleep(0)
    assert admission.waiting("tiny", LONG_CONTEXT_POOL) == (2, 1100)
    assert admission.waiting("tiny", DEFAULT_POOL) == (1, 10)
    assert admission.waiting("tiny") == (3, 1110)

    traffic = TrafficWindow()
    traffic.record_ttft("tiny", 5.0)  # per model: a short request's TTFT must not scale the long pool

    def signals(pool: str) -> rpb.GetPoolSignalsResponse:
        request = rpb.GetPoolSignalsRequest(model="tiny", pool=pool)
        return pool_signals(request, registry, traffic, *admission.waiting("tiny", pool))

    long, short, every = signals(LONG_CONTEXT_POOL), signals(DEFAULT_POOL), signals("")
    assert (long.num_active, long.num_queued_requests, long.num_queued_tokens) == (1, 2, 1100 + 300)
    assert (long.num_used_blocks, long.num_total_blocks, long.ttft_p95_s) == (48, 64, 0.0)
    assert (short.num_active, short.num_queued_requests, short.num_queued_tokens) == (1, 1, 10 + 7)
    assert (short.num_used_blocks, short.ttft_p95_s) == (4, 5.0)
    assert (every.num_active, every.num_queued_tokens, every.num_used_blocks) == (2, 1110 + 307, 52)
    assert every.ttft_p95_s == 5.0
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
