"""AsyncEngine: the engine on its own thread, outputs merged per request, aborts when consumers leave."""

from __future__ import annotations

import asyncio
import threading

import pytest

from flotilla.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.request import FinishReason
from flotilla.engine.sampling_params import SamplingParams

from tests.support.engines import greedy_reference
from .fake_engine import FIRST_TOKEN, FakeEngine
from tests.support.waiting import async_wait_until

ENDLESS = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)


async def started(engine) -> AsyncEngine:
    async_engine = AsyncEngine(lambda: engine)
    await async_engine.start()
    return async_engine


async def generate(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> RequestStream:
    return await engine.generate(NewRequest(request_id, tuple(prompt), params))


async def collect(stream) -> list:
    return [output async for output in stream]


async def wait_first_output(task: asyncio.Task, first: asyncio.Event) -> None:
    """Wait until the consumer task saw an output; re-raise its error if it failed before that."""
    waiter = asyncio.ensure_future(first.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        task.result()
    assert first.is_set(), "no output within 30 s"


# ---- with the fake engine ---------------------------------------------------------------------------
async def test_outputs_waiting_together_come_out_merged():
    fake = FakeEngine()
    engine = await started(fake)
    stream = await generate(engine, "r1", [1, 2, 3], SamplingParams(max_tokens=5))
    await async_wait_until(lambda: not engine.active_request_ids(), what="the request to finish")
    outputs = await collect(stream)
    assert len(outputs) == 1  # five steps' worth of tokens in one output
    assert outputs[0].new_token_ids == [FIRST_TOKEN + i for i in range(5)]
    assert outputs[0].text_delta == "".join(f"<{FIRST_TOKEN + i}>" for i in range(5))
    assert outputs[0].finished and outputs[0].finish_reason is FinishReason.LENGTH
    assert outputs[0].num_output_tokens == 5
    assert fake.num_steps == 5  # no steps without work
    await engine.shutdown()
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids and len(fake.thread_ids) == 1


async def test_a_stream_interval_releases_running_tokens_together():
    fake = FakeEngine(step_seconds=0.02)  # slow steps: the consumer keeps up, so merging is the pacer's
    engine = AsyncEngine(lambda: fake, stream_interval_s=0.05)
    await engine.start()
    stream = await generate(engine, "r1", [1, 2, 3], SamplingParams(max_tokens=7))
    outputs = await collect(stream)
    assert [o.new_token_ids for o in outputs][0] == [FIRST_TOKEN]  # the first token at once
    # then a release every ~3 steps, and the last token at once: 3 or 4 outputs, not 7
    assert len(outputs) <= 4
    assert [t for o in outputs for t in o.new_token_ids] == [FIRST_TOKEN + i for i in range(7)]
    assert outputs[-1].finished and outputs[-1].num_output_tokens == 7
    await engine.shutdown()


async def test_direct_delivery_takes_running_outputs_and_leaves_the_last_to_iteration():
    fake = FakeEngine(step_seconds=0.01)
    engine = await started(fake)
    stream = await generate(engine, "r1", [1, 2, 3], SamplingParams(max_tokens=6))
    direct = []
    stream.deliver_directly(lambda output: direct.append(output) or True)
    iterated = await collect(stream)
    tokens = [t for output in direct + iterated for t in output.new_token_ids]
    assert tokens == [FIRST_TOKEN + i for i in range(6)]  # none lost, none twice, in order
    assert direct and not any(output.finished for output in direct)
    assert len(iterated) == 1 and iterated[0].finished  # the end always comes through iteration
    await engine.shutdown()


async def test_direct_delivery_never_overtakes_an_output_the_consumer_still_holds():
    fake = FakeEngine(step_seconds=0.01)
    engine = await started(fake)
    stream = await generate(engine, "r1", [1, 2, 3], SamplingParams(max_tokens=12))
    await asyncio.sleep(0.025)  # outputs queue before the relay sets its handler (a worker's first ones can)
    sink = []  # where a relay's writes land, direct and iterated alike
    stream.deliver_directly(lambda output: sink.append(output) or True)
    async for output in stream:
        await asyncio.sleep(0.03)  # the consumer holds this output for a few steps before writing it
        sink.append(output)
    assert [t for output in sink for t in output.new_token_ids] == [FIRST_TOKEN + i for i in range(12)]
    await engine.shutdown()


async def test_a_failing_direct_handler_falls_back_to_iteration_without_losing_an_output():
    fake = FakeEngine(step_seconds=0.01)
    engine = await started(fake)
    stream = await generate(engine, "r1", [1, 2, 3], SamplingParams(max_tokens=6))
    stream.deliver_directly(lambda output: 1 / 0)
    outputs = await collect(stream)
    assert [t for output in outputs for t in output.new_token_ids] == [FIRST_TOKEN + i for i in range(6)]
    assert outputs[-1].finished
    await engine.shutdown()


async def test_validation_errors_raise_in_the_caller():
    fake = FakeEngine(max_model_len=10)
    engine = await started(fake)
    with pytest.raises(InvalidRequestError) as bad:
        await generate(engine, "r1", [1], SamplingParams(max_tokens=0))
    assert bad.value.field == "max_tokens"
    with pytest.raises(ContextLengthError):
        await generate(engine, "r2", [1] * 8, SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError):
        await generate(engine, "", [1], SamplingParams())
    stream = await generate(engine, "r3", [1], SamplingParams(max_tokens=1))  # a failed id can be used again
    assert [o.finished for o in await collect(stream)] == [True]
    await engine.shutdown()


async def test_duplicate_request_id_is_refused_while_open():
    engine = await started(FakeEngine())
    stream = await generate(engine, "dup", [1], ENDLESS)
    with pytest.raises(InvalidRequestError) as duplicate:
        await generate(engine, "dup", [1], ENDLESS)
    assert duplicate.value.field == "request_id"
    stream.close()
    await engine.shutdown()


async def test_cancelled_consumer_aborts_the_request():
    fake = FakeEngine()
    engine = await started(fake)
    first = asyncio.Event()

    async def consume():
        stream = await generate(engine, "r1", [1, 2], ENDLESS)
        async for _ in stream:
            first.set()

    task = asyncio.create_task(consume())
    await wait_first_output(task, first)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await async_wait_until(lambda: not engine.active_request_ids() and not fake.requests, what="the abort")
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    await engine.shutdown()


async def test_abort_ends_the_stream_with_abort():
    engine = await started(FakeEngine())
    stream = await generate(engine, "r1", [1, 2], ENDLESS)
    assert await engine.abort("r1") is True
    outputs = await collect(stream)
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.ABORT
    assert outputs[-1].num_prompt_tokens == 2
    assert sum(len(o.new_token_ids) for o in outputs) == outputs[-1].num_output_tokens
    assert await engine.abort("r1") is False
    await engine.shutdown()


async def test_shutdown_ends_open_streams_and_refuses_new_ones():
    engine = await started(FakeEngine())
    stream = await generate(engine, "r1", [1], ENDLESS)
    await engine.shutdown()
    outputs = await collect(stream)
    assert outputs[-1].finish_reason is FinishReason.ABORT
    with pytest.raises(EngineDeadError):
        await generate(engine, "r2", [1], SamplingParams())


async def test_a_failing_step_fails_open_streams_and_new_requests():
    fake = FakeEngine()
    engine = await started(fake)
    stream = await generate(engine, "r1", [1], ENDLESS)
    fake.fail_next_step = True
    with pytest.raises(EngineDeadError):
        await collect(stream)
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        await generate(engine, "r2", [1], SamplingParams())
    await engine.shutdown()


async def test_start_reports_a_failing_factory():
    def broken():
        raise FileNotFoundError("no checkpoint")

    engine = AsyncEngine(broken)
    with pytest.raises(FileNotFoundError):
        await engine.start()


# ---- with the real engine on the tiny checkpoint ----------------------------------------------------
PROMPTS = [[3, 14, 15, 92, 65], list(range(200, 220)), [7] * 37]


async def test_concurrent_generate_equals_offline(tiny_engine):
    expected = greedy_reference(tiny_engine, PROMPTS, max_tokens=6)
    engine = await started(tiny_engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    streams = [await generate(engine, f"c{i}", prompt, params) for i, prompt in enumerate(PROMPTS)]
    results = await asyncio.gather(*(collect(stream) for stream in streams))
    assert [[t for o in outputs for t in o.new_token_ids] for outputs in results] == expected
    assert all(outputs[-1].finish_reason is FinishReason.LENGTH for outputs in results)
    await engine.shutdown()


async def test_consumer_cancel_frees_the_blocks(tiny_engine):
    engine = await started(tiny_engine)
    total = engine.stats().num_total_blocks
    num_tokens_before = engine.stats().num_output_tokens_total
    first = asyncio.Event()

    async def consume():
        stream = await generate(engine, "long", list(range(1, 40)), SamplingParams(max_tokens=900, ignore_eos=True))
        async for _ in stream:
            first.set()

    task = asyncio.create_task(consume())
    await wait_first_output(task, first)
    assert engine.stats().num_free_blocks < total
    task.cancel()
    await async_wait_until(lambda: not engine.active_request_ids() and engine.stats().num_free_blocks == total,
                           what="the aborted request's blocks")
    assert engine.stats().num_output_tokens_total - num_tokens_before < 900  # aborted, not run to the end
    assert engine.integrity_ok and tiny_engine.check_integrity()
    await engine.shutdown()
