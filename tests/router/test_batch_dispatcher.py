"""The fixed-batch dispatcher (router/batch_dispatcher.py) against fake workers (a RunBatch stub per worker,
gated by the test): every call answered exactly once with its own output, in order within a batch; a worker
lost mid-batch re-dispatches the batch elsewhere (bounded); paid calls lead every flush; calls past their
deadline are dropped before dispatch; the flush wait comes from the budget."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.router.batch_dispatcher import BatchDispatcher, BatchSettings
from flotilla.router.registry import WorkerRegistry
from flotilla.rpc.session_client import rpc_error
from flotilla.worker.fixed_batch.simulated import transform

from tests.support.waiting import async_wait_until

MODEL = "sim"


class FakeWorker:
    """RunBatch as a worker answers it: outputs = transform(inputs); `gate` holds calls until the test opens it;
    `fail_with` makes the next call fail with that status (as a killed worker's call does)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.fail_with: grpc.StatusCode | None = None
        self.num_failures = 1  # how many calls in a row fail_with fails
        self.running = 0

    async def RunBatch(self, request: wpb.RunBatchRequest, timeout: float) -> wpb.RunBatchResponse:
        self.batches.append(list(request.inputs))
        self.running += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_with is not None and self.num_failures > 0:
                self.num_failures -= 1
                raise rpc_error(self.fail_with, "worker gone")
            return wpb.RunBatchResponse(outputs=[transform(text) for text in request.inputs])
        finally:
            self.running -= 1


@contextlib.asynccontextmanager
async def dispatcher(num_workers: int = 2, max_batch_size: int = 50, latency_ms: int = 200, **settings):
    registry = WorkerRegistry(heartbeat_timeout_s=1e9, channel_factory=lambda address: grpc.aio.insecure_channel(address))
    workers = {}
    for i in range(num_workers):
        info = rpb.WorkerInfo(worker_id=f"w{i}", address=f"127.0.0.1:{9 + i}", model=pb.ModelInfo(name=MODEL, version="v"),
                              fixed_batch=rpb.FixedBatchInfo(max_batch_size=max_batch_size,
                                                             batch_latency_ms=latency_ms))
        entry = registry.register(info)
        entry._batch_stub = workers[entry.worker_id] = FakeWorker()
    batches = BatchDispatcher(registry, BatchSettings(**settings))
    loop = asyncio.create_task(batches.run_forever())
    try:
        yield batches, workers, registry
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


class Caller:
    """Submits calls and records every result it gets, to check each call is answered exactly once."""

    def __init__(self, batches: BatchDispatcher):
        self._batches = batches
        self.results: dict[int, list[rpb.BatchResult]] = {}
        self.done: dict[int, asyncio.Future] = {}

    def submit(self, call_id: int, text: str, tier: str = "free", deadline_unix_s: float = 0.0):
        future = asyncio.get_running_loop().create_future()
        self.done[call_id] = future

        def resolve(result: rpb.BatchResult) -> None:
            self.results.setdefault(call_id, []).append(result)
            if not future.done():
                future.set_result(result)

        call = rpb.BatchCall(call_id=call_id, model=MODEL, input=text, tier=tier, deadline_unix_s=deadline_unix_s)
        return self._batches.submit(call, resolve)

    async def all(self) -> dict[int, rpb.BatchResult]:
        await asyncio.wait_for(asyncio.gather(*self.done.values()), 30)
        return {call_id: future.result() for call_id, future in self.done.items()}


async def test_a_thousand_concurrent_calls_each_get_their_own_output_in_batch_order():
    async with dispatcher(num_workers=3, max_batch_size=50, max_wait_ms=5) as (batches, workers, _):
        caller = Caller(batches)
        texts = {i: f"input {i} {'x' * (i % 7)}" for i in range(1000)}
        for i, text in texts.items():
            caller.submit(i, text, tier="paid" if i % 3 == 0 else "free")
        results = await caller.all()
    assert all(len(answers) == 1 for answers in caller.results.values()) and len(caller.results) == 1000
    assert {i: r.output for i, r in results.items()} == {i: transform(t) for i, t in texts.items()}
    # Order within a batch: the worker's inputs, position by position, are the calls' batch indexes.
    by_batch: dict[str, list[rpb.BatchResult]] = {}
    for i, result in results.items():
        by_batch.setdefault(result.batch_id, []).append(result)
        assert result.num_attempts == 1 and 1 <= result.batch_size <= 50
    sent = [batch for worker in workers.values() for batch in worker.batches]
    assert sum(map(len, sent)) == 1000  # nobody's input ran twice
    for members in by_batch.values():
        members.sort(key=lambda r: r.batch_index)
        assert [r.batch_index for r in members] == list(range(members[0].batch_size))
        inputs = [texts[r.call_id] for r in members]
        assert inputs in sent
    assert not batches.inflight


async def test_a_worker_lost_mid_batch_has_its_batch_rerun_elsewhere_and_each_call_answered_once():
    async with dispatcher(num_workers=2, max_batch_size=10, max_wait_ms=0) as (batches, workers, registry):
        for worker in workers.values():
            worker.gate = asyncio.Event()
        caller = Caller(batches)
        for i in range(20):
            caller.submit(i, f"q{i}")
        await async_wait_until(lambda: all(w.running for w in workers.values()), what="both workers busy")
        assert sorted(len(f.calls) for f in batches.inflight.values()) == [10, 10]
        doomed = workers["w0"]
        doomed.fail_with = grpc.StatusCode.UNAVAILABLE
        doomed.gate.set()  # its call fails: the batch goes back, to w1 (w0 is marked failed)
        await async_wait_until(lambda: registry.get("w0").failed, what="w0 marked failed")
        workers["w1"].gate.set()
        results = await caller.all()
    assert all(len(answers) == 1 for answers in caller.results.values())
    assert {i: r.output for i, r in results.items()} == {i: transform(f"q{i}") for i in range(20)}
    rerun = [r for r in results.values() if r.num_attempts == 2]
    assert len(rerun) == 10 and {r.worker_id for r in rerun} == {"w1"}
    assert workers["w1"].batches[1] == workers["w0"].batches[0]  # the same batch, in the same order


async def test_a_batch_that_fails_on_every_attempt_answers_unavailable_once():
    async with dispatcher(num_workers=1, max_batch_size=5, max_wait_ms=0, max_attempts=2) as (batches, workers, reg):
        worker = workers["w0"]
        worker.fail_with, worker.num_failures = grpc.StatusCode.INTERNAL, 5  # run_batch raises: tried again
        caller = Caller(batches)
        for i in range(3):
            caller.submit(i, f"q{i}")
        results = await caller.all()
    assert not reg.get("w0").failed  # INTERNAL is the backend's failure, not a lost worker
    assert worker.batches == [["q0", "q1", "q2"]] * 2
    assert all(len(a) == 1 for a in caller.results.values())
    assert {r.error.code for r in results.values()} == {pb.ERROR_CODE_UNAVAILABLE}
    assert "2 workers" in results[0].error.message


async def test_paid_calls_never_wait_behind_free_ones_in_the_same_flush():
    async with dispatcher(num_workers=1, max_batch_size=10, max_wait_ms=0) as (batches, workers, _):
        worker = workers["w0"]
        worker.gate = asyncio.Event()
        caller = Caller(batches)
        caller.submit(0, "first")  # takes the only worker
        await async_wait_until(lambda: worker.running, what="the worker busy")
        for i in range(1, 16):
            caller.submit(i, f"free{i}", tier="free")
        for i in range(16, 22):
            caller.submit(i, f"paid{i}", tier="paid")
        worker.gate.set()
        results = await caller.all()
    second = worker.batches[1]
    assert second[:6] == [f"paid{i}" for i in range(16, 22)]  # every paid call, first, though they came last
    assert second[6:] == [f"free{i}" for i in range(1, 5)]
    assert all(results[i].batch_index < 6 for i in range(16, 22))


async def test_calls_past_their_deadline_are_dropped_before_dispatch():
    async with dispatcher(num_workers=1, max_batch_size=10, max_wait_ms=0) as (batches, workers, _):
        worker = workers["w0"]
        worker.gate = asyncio.Event()
        caller = Caller(batches)
        caller.submit(0, "busy")
        await async_wait_until(lambda: worker.running, what="the worker busy")
        caller.submit(1, "late", deadline_unix_s=time.time() + 0.05)
        caller.submit(2, "patient", deadline_unix_s=time.time() + 60)
        await asyncio.wait_for(caller.done[1], 10)  # the expiry sweep answers it while the worker is busy
        worker.gate.set()
        results = await caller.all()
    assert results[1].error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
    assert results[2].output == transform("patient")
    assert "late" not in [text for batch in worker.batches for text in batch]


async def test_an_unknown_model_and_a_full_queue_are_answered_at_once():
    async with dispatcher(num_workers=1, max_batch_size=2, max_wait_ms=10_000, max_queue_depth=1) as (batches, _, _r):
        answers = []
        assert batches.submit(rpb.BatchCall(call_id=1, model="nope", input="x"), answers.append) is None
        assert answers[-1].error.code == pb.ERROR_CODE_MODEL_NOT_FOUND
        assert batches.submit(rpb.BatchCall(call_id=2, model=MODEL, input="x"), answers.append) is not None
        assert batches.submit(rpb.BatchCall(call_id=3, model=MODEL, input="y"), answers.append) is None
        assert answers[-1].error.code == pb.ERROR_CODE_OVERLOADED


async def test_a_partial_batch_leaves_after_the_flush_wait_and_a_cancelled_call_is_not_answered():
    async with dispatcher(num_workers=1, max_batch_size=50, max_wait_ms=50) as (batches, workers, _):
        caller = Caller(batches)
        gone = caller.submit(0, "gone")
        caller.submit(1, "stays")
        batches.cancel(gone, MODEL)
        result = await asyncio.wait_for(caller.done[1], 10)
    assert result.batch_size == 1 and workers["w0"].batches == [["stays"]]
    assert 0 not in caller.results


@pytest.mark.parametrize(("budget_ms", "latency_ms", "expected_s"), [(500, 200, 0.1), (500, 100, 0.3), (300, 200, 0.0)])
def test_the_flush_wait_comes_from_the_budget(budget_ms, latency_ms, expected_s):
    assert BatchSettings(latency_budget_ms=budget_ms).flush_wait_s(latency_ms) == pytest.approx(expected_s)
    assert BatchSettings(latency_budget_ms=budget_ms, max_wait_ms=20).flush_wait_s(latency_ms) == 0.02
