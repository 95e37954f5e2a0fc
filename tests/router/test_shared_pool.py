"""The router's shared pool: which worker loads a model, placement only where a model is loaded, the load
counted in the wait estimate, and the cold-start bound (MODEL_STARTING with a Retry-After). Shared-pool
workers are registry entries whose LoadModel is a stand-in."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.router.admission import Admission, RouterError
from flotilla.router.placement import PlacementLimits
from flotilla.router.registry import WorkerRegistry
from flotilla.router.shared_pool import SharedWorkerView, choose_load_worker

MODELS = ("rare-a", "rare-b", "rare-c")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class LoadingStub:
    """A shared worker's LoadModel: records the call, answers once `gate` is set (or fails)."""

    def __init__(self, entry, fail: bool = False):
        self.entry, self.fail = entry, fail
        self.calls: list[str] = []
        self.gate = asyncio.Event()

    async def LoadModel(self, request, timeout=None):
        self.calls.append(request.model)
        await self.gate.wait()
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="no weights")
        loaded = [q for q in self.entry.report.loaded_models if q != request.model][-1:] + [request.model]
        return wpb.LoadModelResponse(loaded_models=loaded, load_seconds=2.0)


def make(cold_wait_s: float = 30.0):
    clock = Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=1.0, clock=clock,
                              channel_factory=lambda address: grpc.aio.insecure_channel(address))
    admission = Admission(registry, {}, (), PlacementLimits(32_768, 4), 8, 30.0, cold_start_wait_s=cold_wait_s)
    return registry, admission, clock


def register_shared(registry, worker_id, loaded=(), max_loaded=2, fail=False) -> LoadingStub:
    models = [pb.ModelInfo(name=name, version="v1", max_model_len=512) for name in MODELS]
    entry = registry.register(rpb.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9",
                                             shared=rpb.SharedModels(models=models, max_loaded_models=max_loaded)))
    assert registry.heartbeat(worker_id, pb.LoadReport(num_free_blocks=64, num_total_blocks=64, block_size=16,
                                                       loaded_models=[f"{m}@v1" for m in loaded]))
    entry.stub = LoadingStub(entry, fail)
    return entry.stub


def test_a_load_goes_to_a_free_slot_else_to_the_least_recently_used_worker():
    views = [SharedWorkerView("w1", 2, 2, last_used=5.0), SharedWorkerView("w2", 1, 2, last_used=9.0)]
    assert choose_load_worker(views) == "w2"  # a free slot beats recency
    full = [SharedWorkerView("w1", 2, 2, last_used=5.0), SharedWorkerView("w2", 2, 2, last_used=3.0)]
    assert choose_load_worker(full) == "w2"
    assert choose_load_worker([SharedWorkerView("w1", 1, 1, 0.0), SharedWorkerView("w0", 1, 1, 0.0)]) == "w0"
    assert choose_load_worker([]) is None


async def test_shared_models_are_listed_and_cold_until_loaded():
    registry, admission, _ = make()
    register_shared(registry, "s1", loaded=("rare-a",))
    assert {(r.name, r.version) for r in registry.model_versions()} == {(m, "v1") for m in MODELS}
    assert registry.model_info("rare-b", "v1").max_model_len == 512
    assert registry.has_active_replica("rare-a") and not registry.has_active_replica("rare-b")
    placement = await admission.acquire("rare-a", 5)  # loaded: placed at once, no load asked for
    assert placement.worker.worker_id == "s1" and placement.resolution.qualified == "rare-a@v1"
    assert registry.get("s1").stub.calls == []


async def test_a_request_for_an_unloaded_model_waits_for_its_load_then_runs_there():
    registry, admission, _ = make()
    busy = register_shared(registry, "s1", loaded=("rare-a", "rare-b"))
    free = register_shared(registry, "s2", loaded=("rare-a",))
    task = asyncio.create_task(admission.acquire("rare-c", 5))
    await asyncio.sleep(0.01)
    assert free.calls == ["rare-c@v1"] and busy.calls == [] and not task.done()
    # While s2 loads, nothing new goes there (what it unloads is not known yet): rare-a runs on s1.
    assert (await admission.acquire("rare-a", 5)).worker.worker_id == "s1"
    free.gate.set()
    placement = await asyncio.wait_for(task, 5)
    assert placement.worker.worker_id == "s2" and registry.get("s2").has_loaded("rare-c@v1")
    assert admission.shared.load_times.estimate("rare-c@v1") == 2.0


async def test_the_least_recently_used_worker_loads_when_all_are_full():
    registry, admission, clock = make()
    first = register_shared(registry, "s1", loaded=("rare-a", "rare-b"))
    second = register_shared(registry, "s2", loaded=("rare-b", "rare-a"))
    (await admission.acquire("rare-a", 5))  # placed on s1 or s2; both idle: headroom ties break by id
    clock.now += 1
    for stub in (first, second):
        stub.gate.set()
    await admission.acquire("rare-c", 5)
    assert first.calls == [] and second.calls == ["rare-c@v1"]  # s1 was used last


async def test_the_load_counts_in_the_wait_and_a_load_beyond_the_bound_says_starting_at_once():
    registry, admission, _ = make(cold_wait_s=10.0)
    stub = register_shared(registry, "s1")
    admission.shared.load_times.observe("rare-b@v1", 40.0)
    assert admission.estimated_wait_s("rare-b") == 40.0
    with pytest.raises(RouterError) as error:
        await admission.acquire("rare-b", 5)
    assert error.value.code == pb.ERROR_CODE_MODEL_STARTING and error.value.retry_after_s == 40.0
    await asyncio.sleep(0)
    assert "rare-b" in error.value.message and stub.calls == ["rare-b@v1"]  # the load started for the retry
    assert admission.estimated_wait_s("rare-a") is None  # never loaded: unknown, not a guess


async def test_a_loaded_models_wait_counts_its_shared_workers_queue():
    registry, admission, clock = make()
    register_shared(registry, "s1", loaded=("rare-a",))
    for total in (0, 1000):  # 1000 tokens/s while busy
        clock.now += 1.0
        assert registry.heartbeat("s1", pb.LoadReport(num_running=1, num_queued_tokens=500, num_free_blocks=64,
                                                      num_total_blocks=64, block_size=16, loaded_models=["rare-a@v1"],
                                                      num_prompt_tokens_total=total))
        admission.dispatch()  # what the router does on each heartbeat (a throughput sample)
    assert admission.estimated_wait_s("rare-a") == pytest.approx(0.5)  # loaded: its queue, no load time


async def test_a_model_that_cannot_load_is_starting_once_the_bound_passes():
    registry, admission, _ = make(cold_wait_s=0.2)
    stub = register_shared(registry, "s1", fail=True)
    stub.gate.set()
    with pytest.raises(RouterError) as error:
        await admission.acquire("rare-a", 5)
    assert error.value.code == pb.ERROR_CODE_MODEL_STARTING and error.value.retry_after_s > 0
    assert stub.calls == ["rare-a@v1"]  # asked once: a failed load backs off instead of hammering the worker


async def test_a_busy_model_is_loaded_on_one_more_worker_only_into_a_free_slot():
    registry, admission, _ = make()
    register_shared(registry, "s1", loaded=("rare-a",))
    full = register_shared(registry, "s2", loaded=("rare-b", "rare-c"))
    for _ in range(4):  # s1's room (4 requests a worker)
        await admission.acquire("rare-a", 5)
    queued = asyncio.create_task(admission.acquire("rare-a", 5))
    await asyncio.sleep(0.01)
    assert not queued.done() and full.calls == []  # s2 has no free slot: nothing of it is unloaded for rare-a
    free = register_shared(registry, "s3", loaded=("rare-b",))
    admission.dispatch()
    await asyncio.sleep(0.01)
    assert free.calls == ["rare-a@v1"]
    free.gate.set()
    assert (await asyncio.wait_for(queued, 5)).worker.worker_id == "s3"
