"""ProcessEngine: the engine in a child process, with AsyncEngine's contract (exact outputs, errors in the
caller, aborts), and no process left behind when either side dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from flotilla.engine.async_engine import EngineDeadError
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.process_engine import ProcessEngine
from flotilla.engine.request import FinishReason
from flotilla.engine.sampling_params import SamplingParams

from tests.support.engines import engine_config, greedy_reference
from tests.support.waiting import async_wait_until, wait_until

from .test_async_engine import PROMPTS, collect

pytestmark = pytest.mark.integration  # it starts processes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENDLESS = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)


def integrity(engine) -> bool:
    """Runs in the child (call() takes module-level functions)."""
    return engine.check_integrity()


async def started(model_dir) -> ProcessEngine:
    engine = ProcessEngine(engine_config(model_dir))
    await engine.start()
    return engine


async def test_streams_equal_the_offline_engine_and_errors_reach_the_caller(tiny_checkpoint, tiny_engine):
    expected = greedy_reference(tiny_engine, PROMPTS, max_tokens=6)
    engine = await started(tiny_checkpoint)
    try:
        assert engine.engine.max_model_len == tiny_engine.max_model_len
        assert engine.engine.model_version == tiny_engine.model_version
        streams = [await engine.generate(NewRequest(f"c{i}", tuple(p), GREEDY)) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(collect(stream) for stream in streams))
        assert [[t for o in outputs for t in o.new_token_ids] for outputs in results] == expected
        assert all(outputs[-1].finish_reason is FinishReason.LENGTH for outputs in results)
        with pytest.raises(ContextLengthError):  # the engine's own error, raised here
            await engine.generate(NewRequest("long", tuple([5] * (engine.engine.max_model_len + 1)), GREEDY))
        open_stream = await engine.generate(NewRequest("dup", (1, 2, 3), ENDLESS))
        with pytest.raises(InvalidRequestError):
            await engine.generate(NewRequest("dup", (1, 2, 3), ENDLESS))
        assert await engine.abort("dup")
        outputs = await collect(open_stream)
        assert outputs[-1].finish_reason is FinishReason.ABORT
        await async_wait_until(lambda: engine.stats().num_free_blocks == engine.stats().num_total_blocks,
                               what="every block free")
        assert await engine.call(integrity) and engine.integrity_ok
    finally:
        await engine.shutdown()
    with pytest.raises(EngineDeadError):
        await engine.generate(NewRequest("late", (1, 2), GREEDY))


async def test_a_consumer_that_leaves_aborts_and_shutdown_ends_open_streams(tiny_checkpoint):
    engine = await started(tiny_checkpoint)
    try:
        leaving = await engine.generate(NewRequest("leaving", tuple(range(1, 40)), ENDLESS))
        await anext(leaving)
        leaving.close()
        await async_wait_until(lambda: not engine.active_request_ids(), what="the abort to land")
        staying = await engine.generate(NewRequest("staying", (4, 5, 6), ENDLESS))
        await anext(staying)
    finally:
        await engine.shutdown()
    rest = await collect(staying)
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert not engine.is_running


async def test_a_dead_engine_process_fails_open_streams_and_new_requests(tiny_checkpoint):
    engine = await started(tiny_checkpoint)
    try:
        stream = await engine.generate(NewRequest("r", (1, 2, 3), ENDLESS))
        await anext(stream)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(stream), 30)
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.generate(NewRequest("after", (1, 2), GREEDY))
    finally:
        await engine.shutdown()


PARENT = textwrap.dedent("""
    import asyncio, sys
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.process_engine import ProcessEngine

    async def main():
        engine = ProcessEngine(EngineConfig(model_dir=sys.argv[1], device="cpu", num_kv_blocks=64, block_size=16))
        await engine.start()
        print(engine.pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def test_the_engine_process_ends_with_its_parent_even_on_sigkill(tiny_checkpoint):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_checkpoint)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert os.path.exists(f"/proc/{child_pid}")
    finally:
        parent.kill()
        parent.wait(30)
    wait_until(lambda: not _alive(child_pid), timeout_s=30, what="the engine process to exit")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
