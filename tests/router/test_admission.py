"""Router admission: model resolution, placement on the right weights, the bounded per-model queue, health."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission, RouterError, Ticket
from flotilla.router.placement import PlacementLimits
from flotilla.router.registry import WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(expected=("tiny",), max_requests=4, max_queue_depth=8, max_wait_s=30.0, aliases=None, limits=None,
         cold_wait_s=None):
    clock = Clock()
    # Channels to a closed port: created lazily, never dialled by these tests.
    registry = WorkerRegistry(heartbeat_timeout_s=1.0, clock=clock,
                              channel_factory=lambda address: grpc.aio.insecure_channel(address))
    admission = Admission(registry, aliases or {}, expected, limits or PlacementLimits(32_768, max_requests),
                          max_queue_depth, max_wait_s, cold_start_wait_s=cold_wait_s)
    return registry, admission, clock


def register(registry, worker_id, name="tiny", version="v1", running=0, free=64, queued=0):
    model = pb.ModelInfo(name=name, version=version, max_model_len=2048)
    registry.register(rpb.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9", model=model))
    report(registry, worker_id, running=running, free=free, queued=queued)


def report(registry, worker_id, running=0, free=64, queued=0):
    load = pb.LoadReport(num_running=running, num_free_blocks=free, num_total_blocks=64, block_size=16,
                         num_queued_tokens=queued)
    assert registry.heartbeat(worker_id, load)


async def test_unknown_model_is_not_found():
    _, admission, _ = make()
    with pytest.raises(RouterError) as error:
        await admission.acquire("nope", 5)
    assert error.value.code == pb.ERROR_CODE_MODEL_NOT_FOUND and error.value.field == "model"


async def test_request_waits_for_a_worker_to_register():
    registry, admission, _ = make()
    task = asyncio.create_task(admission.acquire("tiny", 5))
    await asyncio.sleep(0)  # let it queue
    assert admission.queue_depth("tiny") == 1 and not task.done()
    register(registry, "w1")
    admission.dispatch()
    placement = await task
    assert placement.worker.worker_id == "w1" and placement.resolution.qualified == "tiny@v1"
    assert admission.queue_depth("tiny") == 0


async def test_never_placed_on_other_weights():
    registry, admission, clock = make()
    register(registry, "old", version="v1", running=3, queued=500)
    clock.now += 0.1
    register(registry, "new", version="v2")
    register(registry, "same-weights-other-name", name="spare", version="v1")
    assert (await admission.acquire("tiny@v1", 5)).worker.worker_id == "old"  # busier, but the right weights
    assert (await admission.acquire("tiny", 5)).worker.worker_id == "new"  # bare name: newest version


async def test_most_headroom_wins_and_placements_count_until_the_next_report():
    registry, admission, _ = make()
    register(registry, "a")
    register(registry, "b")
    first = (await admission.acquire("tiny", 100)).worker.worker_id
    second = (await admission.acquire("tiny", 100)).worker.worker_id
    assert {first, second} == {"a", "b"}  # the first placement made `first` look busier


async def test_a_retry_avoids_the_worker_it_was_lost_on_while_another_serves_the_model():
    registry, admission, _ = make(max_requests=1)
    register(registry, "lost")  # most headroom: an unavoided request goes here
    register(registry, "other", queued=50)
    assert (await admission.acquire("tiny", 5, avoid=frozenset({"lost"}))).worker.worker_id == "other"
    # The other worker is full now: the retry waits for it rather than going back to the lost one...
    retry = asyncio.create_task(admission.acquire("tiny", 5, avoid=frozenset({"lost"})))
    await asyncio.sleep(0)
    assert admission.queue_depth("tiny") == 1
    registry.release(registry.get("other"))
    admission.dispatch()
    assert (await retry).worker.worker_id == "other"
    # ... unless the lost worker is the only one serving the model (a restarted worker, a transient error).
    registry.deregister("other")
    assert (await admission.acquire("tiny", 5, avoid=frozenset({"lost"}))).worker.worker_id == "lost"


async def test_busy_workers_queue_then_a_heartbeat_dispatches_in_order():
    registry, admission, _ = make(max_requests=1)
    register(registry, "w1")
    first = await admission.acquire("tiny", 5)
    assert first.worker.worker_id == "w1"
    waiting = [asyncio.create_task(admission.acquire("tiny", n)) for n in (6, 7)]
    await asyncio.sleep(0)
    assert admission.queue_depth("tiny") == 2
    report(registry, "w1", running=1)  # a report alone frees nothing: the relay has not ended
    admission.dispatch()
    assert admission.queue_depth("tiny") == 2
    registry.release(first.worker)  # the first request's relay ended: its slot is free at once
    admission.dispatch()
    second = await waiting[0]
    assert second.worker.worker_id == "w1"
    assert not waiting[1].done() and admission.queue_depth("tiny") == 1  # w1 is full again
    registry.release(second.worker)
    report(registry, "w1", running=0)
    admission.dispatch()
    assert (await waiting[1]).worker.worker_id == "w1"


async def test_full_queue_is_overloaded_at_once():
    registry, admission, _ = make(max_requests=1, max_queue_depth=1)
    register(registry, "w1", running=1)
    queued = asyncio.create_task(admission.acquire("tiny", 5))
    await asyncio.sleep(0)
    with pytest.raises(RouterError) as error:
        await admission.acquire("tiny", 5)
    assert error.value.code == pb.ERROR_CODE_OVERLOADED
    queued.cancel()


async def test_wait_budget_ends_in_model_starting_or_overloaded():
    registry, admission, _ = make(max_requests=1, max_wait_s=0.05)
    with pytest.raises(RouterError) as nobody:  # a known model with no replica yet: cold, "is starting"
        await admission.acquire("tiny", 5)
    assert nobody.value.code == pb.ERROR_CODE_MODEL_STARTING and nobody.value.retry_after_s > 0
    assert "'tiny' is starting" in nobody.value.message
    register(registry, "w1", running=1)
    with pytest.raises(RouterError) as busy:
        await admission.acquire("tiny", 5)
    assert busy.value.code == pb.ERROR_CODE_OVERLOADED
    assert admission.queue_depth("tiny") == 0


async def test_missed_heartbeats_make_a_worker_unhealthy_and_a_heartbeat_heals_it():
    registry, admission, clock = make(max_wait_s=0.0)
    register(registry, "w1")
    clock.now += 1.5
    assert registry.healthy_workers("tiny", "v1") == []
    with pytest.raises(RouterError) as error:
        await admission.acquire("tiny", 5)
    assert error.value.code == pb.ERROR_CODE_UNAVAILABLE
    report(registry, "w1")
    assert [w.worker_id for w in registry.healthy_workers("tiny", "v1")] == ["w1"]
    registry.mark_failed("w1")  # a call could not reach it
    assert registry.healthy_workers("tiny", "v1") == []
    assert registry.heartbeat("ghost", pb.LoadReport()) is False  # unknown: told to register again


async def test_aliases_resolve_before_placement():
    registry, admission, _ = make(expected=(), aliases={"default": "tiny"})
    register(registry, "w1")
    assert (await admission.acquire("default", 5)).resolution.qualified == "tiny@v1"


async def test_a_batch_request_waits_for_free_kv_above_the_watermark():
    registry, admission, _ = make(limits=PlacementLimits(32_768, 4, batch_min_free_kv_fraction=0.5))
    register(registry, "w1", free=16)  # 16 of 64 blocks free: under the watermark
    batch = asyncio.create_task(admission.acquire("tiny", 5, ticket=Ticket(priority=pb.PRIORITY_CLASS_BATCH)))
    await asyncio.sleep(0)
    assert admission.queue_depth("tiny", pb.PRIORITY_CLASS_BATCH) == 1 and not batch.done()
    interactive = await admission.acquire("tiny", 5)  # placed at once on the same worker
    assert interactive.worker.worker_id == "w1"
    report(registry, "w1", free=48)
    admission.dispatch()
    assert (await batch).worker.worker_id == "w1"


async def test_cold_start_has_its_own_wait_bound_and_warm_replicas_still_count_as_starting():
    registry, admission, _ = make(max_wait_s=30.0, cold_wait_s=0.05)
    registry.set_state("w1", rpb.WORKER_STATE_WARM)  # the supervisor starts replicas warm
    register(registry, "w1")
    with pytest.raises(RouterError) as cold:
        await admission.acquire("tiny", 5)
    assert cold.value.code == pb.ERROR_CODE_MODEL_STARTING
    task = asyncio.create_task(admission.acquire("tiny", 5))
    await asyncio.sleep(0)
    registry.set_state("w1", rpb.WORKER_STATE_ACTIVE)  # promoted: the waiting request is placed
    admission.dispatch()
    assert (await task).worker.worker_id == "w1"
