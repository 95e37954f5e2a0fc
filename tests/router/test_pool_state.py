"""Router side of autoscaling: warm and draining workers get no new work, a promoted one takes the queue,
states declared before registration, and the pool signals the autoscaler reads."""

from __future__ import annotations

import asyncio

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission
from flotilla.router.placement import PlacementLimits
from flotilla.router.pool_signals import pool_signals
from flotilla.router.registry import WorkerRegistry
from flotilla.router.traffic import MAX_WINDOW_S, TrafficWindow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make():
    clock = Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=1.0, evict_after_s=60.0, clock=clock,
                              channel_factory=lambda address: grpc.aio.insecure_channel(address))
    admission = Admission(registry, {}, ("tiny",), PlacementLimits(32_768, 1), 8, 30.0)
    return registry, admission, clock


def register(registry, worker_id, free=64, queued=0, running=0):
    model = pb.ModelInfo(name="tiny", version="v1", max_model_len=2048)
    registry.register(rpb.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9", model=model,
                                     role=pb.WORKER_ROLE_BOTH))
    load = pb.LoadReport(num_running=running, num_free_blocks=free, num_total_blocks=64, block_size=16,
                         num_queued_tokens=queued)
    assert registry.heartbeat(worker_id, load)


async def test_warm_worker_gets_no_work_until_promoted():
    registry, admission, _ = make()
    assert registry.set_state("w-warm", rpb.WORKER_STATE_WARM) == (False, rpb.WORKER_STATE_UNSPECIFIED)
    register(registry, "w-warm")  # the declared state applies at registration: never in rotation
    register(registry, "w-busy", running=1)  # one request per worker: busy
    assert registry.get("w-warm").state == rpb.WORKER_STATE_WARM
    task = asyncio.create_task(admission.acquire("tiny", 10))
    await asyncio.sleep(0)
    assert admission.queue_depth("tiny") == 1 and admission.queued_tokens("tiny") == 10
    assert registry.set_state("w-warm", rpb.WORKER_STATE_ACTIVE) == (True, rpb.WORKER_STATE_WARM)
    admission.dispatch()
    placement = await asyncio.wait_for(task, 1.0)
    assert placement.worker.worker_id == "w-warm"


async def test_draining_worker_leaves_rotation_and_reports_inflight():
    registry, admission, _ = make()
    register(registry, "w1")
    register(registry, "w2")
    registry.set_state("w1", rpb.WORKER_STATE_DRAINING)
    registry.get("w1").num_inflight = 2
    assert [e.worker_id for e in registry.healthy_workers("tiny", "v1")] == ["w2"]
    status = registry.status(registry.get("w1"))
    assert (status.state, status.num_inflight) == (rpb.WORKER_STATE_DRAINING, 2)
    placement = await admission.acquire("tiny", 5)
    assert placement.worker.worker_id == "w2"


async def test_state_survives_re_registration_and_pending_states_expire():
    registry, _, clock = make()
    register(registry, "w1")
    registry.set_state("w1", rpb.WORKER_STATE_WARM)
    register(registry, "w1")  # the router asked it to register again: still warm
    assert registry.get("w1").state == rpb.WORKER_STATE_WARM
    registry.set_state("ghost", rpb.WORKER_STATE_WARM)
    clock.now += 61.0
    await registry.sweep()
    register(registry, "ghost")
    assert registry.get("ghost").state == rpb.WORKER_STATE_ACTIVE


async def test_pool_signals_count_states_tokens_kv_ttft_and_mix():
    registry, _, clock = make()
    register(registry, "a1", free=48, queued=100)
    register(registry, "a2", free=16, queued=300)
    register(registry, "w1", free=64, queued=0)
    registry.set_state("w1", rpb.WORKER_STATE_WARM)
    register(registry, "d1", free=0, queued=999)
    registry.set_state("d1", rpb.WORKER_STATE_DRAINING)
    traffic = TrafficWindow(clock)
    for ttft in [0.1] * 18 + [0.9, 2.0]:
        traffic.record_ttft("tiny", ttft)
    traffic.record_prompt("tiny", 400)
    traffic.record_output("tiny", 100)
    clock.now += 40.0
    traffic.record_prompt("tiny", 50)  # only this one is inside a 30 s window
    signals = pool_signals(rpb.GetPoolSignalsRequest(model="tiny", window_s=30.0), registry, traffic, 2, 70)
    # Heartbeats went stale while the clock moved 40 s: only fresh workers count as active.
    assert signals.num_active == 0 and signals.num_warm == 1 and signals.num_draining == 1
    for worker_id in ("a1", "a2"):
        registry.heartbeat(worker_id, registry.get(worker_id).report)
    signals = pool_signals(rpb.GetPoolSignalsRequest(model="tiny", window_s=30.0), registry, traffic, 2, 70)
    assert (signals.num_active, signals.num_queued_requests, signals.num_queued_tokens) == (2, 2, 470)
    assert (signals.num_used_blocks, signals.num_total_blocks) == (64, 128)
    assert (signals.num_prompt_tokens, signals.num_output_tokens, signals.num_ttft_samples) == (50, 0, 0)
    wide = pool_signals(rpb.GetPoolSignalsRequest(model="tiny", window_s=120.0), registry, traffic, 0, 0)
    assert (wide.num_prompt_tokens, wide.num_output_tokens, wide.num_ttft_samples) == (450, 100, 20)
    assert wide.ttft_p95_s == 0.9  # 19th of 20 sorted samples
    other_role = rpb.GetPoolSignalsRequest(model="tiny", role=pb.WORKER_ROLE_PREFILL)
    assert pool_signals(other_role, registry, traffic, 0, 0).num_active == 0


# TrafficWindow keeps token counts per second: a burst of relayed chunks is one entry, counts stay exact,
# and the window's start and the 300 s horizon are honoured to the second.
def test_chunks_in_one_second_are_one_entry_and_counts_are_exact():
    clock = Clock()
    clock.now = 1000.0
    traffic = TrafficWindow(clock)
    for i in range(5000):  # 5,000 relayed chunks within one second
        clock.now = 1000.0 + i / 5001
        traffic.record_output("m", 2)
    traffic.record_prompt("m", 7)
    assert len(traffic._models["m"].output_tokens) == 1
    assert traffic.snapshot("m", 30.0).num_output_tokens == 10_000
    assert traffic.snapshot("m", 30.0).num_prompt_tokens == 7


def test_the_window_and_the_horizon_cut_by_whole_seconds():
    clock = Clock()
    clock.now = 1000.0
    traffic = TrafficWindow(clock)
    traffic.record_output("m", 1)  # second 1000
    clock.now = 1010.5
    traffic.record_output("m", 10)  # second 1010
    clock.now = 1030.2
    assert traffic.snapshot("m", 20.0).num_output_tokens == 10  # window from 1010.2: second 1010 counts
    assert traffic.snapshot("m", 31.0).num_output_tokens == 11
    clock.now = 1000.0 + MAX_WINDOW_S + 1.0
    assert traffic.snapshot("m", MAX_WINDOW_S).num_output_tokens == 10  # second 1000 fell off the horizon


async def test_idle_time_counts_from_the_last_placed_request_else_from_the_routers_start():
    clock = Clock()
    traffic = TrafficWindow(clock)
    clock.now += 7.0
    assert traffic.snapshot("tiny", 30.0).seconds_since_last_request == 7.0  # none yet: since the start
    traffic.record_prompt("tiny", 5)
    clock.now += 2.5
    assert traffic.snapshot("tiny", 30.0).seconds_since_last_request == 2.5
    registry, _, _ = make()
    signals = pool_signals(rpb.GetPoolSignalsRequest(model="tiny"), registry, traffic, 0, 0)
    assert signals.seconds_since_last_request == 2.5


async def test_seconds_in_state_restart_when_the_state_changes_and_survive_re_registration():
    registry, _, clock = make()
    register(registry, "w1")
    clock.now += 4.0
    assert registry.status(registry.get("w1")).seconds_in_state == 4.0  # since it registered
    registry.set_state("w1", rpb.WORKER_STATE_DRAINING)
    clock.now += 1.5
    registry.set_state("w1", rpb.WORKER_STATE_DRAINING)  # the same state again: the drain started earlier
    register(registry, "w1")
    clock.now += 0.5
    status = registry.status(registry.get("w1"))
    assert (status.state, status.seconds_in_state) == (rpb.WORKER_STATE_DRAINING, 2.0)
