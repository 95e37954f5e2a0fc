"""Workers with the engine in its own process (`flotilla worker --engine-process`), in the real fleet: streams
equal the in-thread engine's, and an engine process killed mid-stream loses nothing (its streams resume on the
other worker) while its worker exits non-zero for its supervisor to replace."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from loadtest.common.cpu_pinning import spawned_engine_pids
from tests.support.fleet import fleet_config, start_fleet
from tests.support.waiting import wait_until

from .conftest import KEY_ID, TENANT
from .sse_client import stream_completion
# Its prompts and seeds: no seeded draw of theirs lies near a CDF boundary on the tiny checkpoint, where the
# float32 noise of a resumed stream's re-prefill could flip it (see there).
from .test_worker_failure import _body, _prompts

NUM_STREAMS = 16


def _start(checkpoint, state_dir, redis_server, worker_args):
    redis_server.flush()  # each fleet creates the same key
    config = fleet_config(checkpoint, state_dir, num_workers=2, worker_args=["--num-kv-blocks", "512", *worker_args],
                          router_args=["--max-queue-wait-s", "60"], metrics=False)
    fleet = start_fleet(config, redis=redis_server)
    fleet.create_key(TENANT, key_id=KEY_ID)
    return fleet


async def _run_all(fleet, on_event=None):
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(stream_completion(client, fleet.url, fleet.headers, _body(i, prompt), on_event)
                                      for i, prompt in enumerate(_prompts()[:NUM_STREAMS])))


@pytest.fixture(scope="module")
def in_thread_reference(tiny_checkpoint, tmp_path_factory, redis_server):
    with _start(tiny_checkpoint, tmp_path_factory.mktemp("engine-thread"), redis_server, []) as fleet:
        results = asyncio.run(_run_all(fleet))
    assert all(r.error is None and r.done for r in results)
    return results


async def test_an_engine_process_killed_mid_stream_loses_no_stream(tiny_checkpoint, tmp_path_factory, redis_server,
                                                                    in_thread_reference):
    with _start(tiny_checkpoint, tmp_path_factory.mktemp("engine-process"), redis_server,
                ["--engine-process"]) as fleet:
        assert [r.text for r in await _run_all(fleet)] == [r.text for r in in_thread_reference]
        victim = fleet.fleet.workers[1]
        (engine_pid,) = spawned_engine_pids(victim.pid)
        killed = False

        async def kill_its_engine(result) -> None:
            nonlocal killed
            if result.num_chunks >= 2 and not killed:
                killed = True
                os.kill(engine_pid, signal.SIGKILL)

        results = await _run_all(fleet, kill_its_engine)
        assert killed
        assert [r.error for r in results] == [None] * NUM_STREAMS
        assert [r.text for r in results] == [r.text for r in in_thread_reference]
        wait_until(lambda: not victim.is_running(), 30, "the worker whose engine died to exit")
        assert victim.popen.returncode not in (0, None)
        log = (fleet.state_dir / "logs" / f"{victim.name}.log").read_text()
        assert "the engine process died" in log
