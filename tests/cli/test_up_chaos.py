"""Chaos through `flotilla up` itself, as a user runs it (a subprocess serving a tiny random checkpoint, the
openai SDK as client): kill -9 of a worker mid-stream (every stream completes with the text of an undisturbed
run, the worker is restarted and registers again), kill -9 of the router (restarted on its port, the workers
register again, the gateway serves again) and of the gateway, SIGKILL of the launcher (no child survives, every
port is free); with --autoscale, a worker the autoscaler started is restarted and stays warm, and a service that
keeps crashing stops the fleet (the launcher says so with the tail of its log)."""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.usage.record import STATUS_OPEN
from flotilla.usage.sinks import read_file

from tests.support.fleet import MODEL
from tests.support.waiting import wait_until

from .flotilla_up import API_KEY, FlotillaUp, is_free, is_gone, openai_client, start_flotilla_up
from .flotilla_up import chat_stream as shared_chat_stream

NUM_STREAMS = 16
# Long enough that worker-1 still holds streams when the kill lands: the kill follows the client's reading, which
# lags the workers (24 once was not enough; 64 was not once the engine's linears and prefill got ~2x faster).
MAX_TOKENS = 256
KILL_AFTER_CHUNKS = 2  # early: the tiny model's streams are short
TOPICS = ["ships", "harbours", "lighthouses", "tides", "knots", "sails", "anchors", "compasses"]
PROMPTS = [f"Tell me about {TOPICS[i % 8]} number {i}." for i in range(NUM_STREAMS)]
GONE_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def up(tiny_checkpoint, tmp_path_factory):
    up = start_flotilla_up(tiny_checkpoint, tmp_path_factory.mktemp("up") / "state", "--workers", "2",
                           model_name=MODEL, worker_args=["--num-kv-blocks", "512"],
                           router_args=["--max-queue-wait-s", "60"])
    yield up
    up.stop()


async def chat_stream(oai: openai.AsyncOpenAI, prompt: str, on_chunk=None) -> str:
    return await shared_chat_stream(oai, MODEL, prompt, MAX_TOKENS, on_chunk)


async def all_streams(up: FlotillaUp, on_chunk=None) -> list[str]:
    async with openai_client(up) as oai:
        return await asyncio.gather(*(chat_stream(oai, prompt, on_chunk) for prompt in PROMPTS))


def usage_records(up: FlotillaUp, count: int):
    path = up.state_dir / "usage.jsonl"
    # final records only: each request also leaves checkpoints (status open) while it runs
    return wait_until(lambda: len(records := [r for r in read_file(path) if r.status != STATUS_OPEN]) >= count
                      and records, 30,
                      f"{count} usage records", interval_s=0.05)


@pytest.fixture(scope="module")
def reference(up) -> list[str]:
    texts = asyncio.run(all_streams(up))
    usage_records(up, NUM_STREAMS)
    return texts


def test_kill_9_of_a_worker_mid_stream_every_stream_completes_and_the_worker_comes_back(up, reference):
    killed: list[int] = []

    def kill_once(num_chunks: int) -> None:
        if num_chunks >= KILL_AFTER_CHUNKS and not killed:
            killed.append(up.kill("worker-1"))

    texts = asyncio.run(all_streams(up, kill_once))
    assert killed, "no stream got far enough to kill the worker under it"
    assert texts == reference  # every stream completed, with the text of the undisturbed run
    records = usage_records(up, 2 * NUM_STREAMS)[NUM_STREAMS:]
    assert len(records) == NUM_STREAMS and all(r.status == "ok" for r in records)
    assert any(r.attempts == 2 for r in records), "the killed worker held no stream: the test proved nothing"

    up.wait_said("worker-1 exited (killed by SIGKILL); restarting it in 0.5 s")
    up.wait_said("worker-1 is serving again")
    assert up.pid("worker-1") != killed[0] and up.status()["services"]["worker-1"]["restarts"] == 1
    address = f"127.0.0.1:{up.status()['services']['worker-1']['port']}"
    wait_until(lambda: (w := up.router_workers().get("worker-1")) and w.healthy and w.worker.address == address,
               30, "worker-1 registered again at its new address")
    assert up.popen.poll() is None


def test_kill_9_of_the_router_it_comes_back_and_the_fleet_serves_again(up, reference):
    address = up.router_address
    up.kill("router")
    up.wait_said("router is serving again")
    assert up.router_address == address  # the workers and the gateway dial the same address
    wait_until(lambda: sum(w.healthy for w in up.router_workers().values()) == 2, 30,
               "both workers registered with the new router", ignore=(Exception,))

    async def one_chat() -> str:
        async with openai_client(up) as oai:
            return await chat_stream(oai, PROMPTS[0])

    assert asyncio.run(one_chat()) == reference[0]
    assert up.status()["restarts"] == 2 and up.status()["services"]["router"]["restarts"] == 1


def test_kill_9_of_the_gateway_it_comes_back_on_its_port(up, reference):
    up.kill("gateway")
    up.wait_said("gateway is serving again")

    async def one_chat() -> str:
        async with openai_client(up) as oai:
            return await chat_stream(oai, PROMPTS[1])

    assert asyncio.run(one_chat()) == reference[1]  # at the URL flotilla up printed
    assert up.status()["services"]["gateway"]["restarts"] == 1


def test_sigkill_of_the_launcher_leaves_no_service_running(up):
    pids, ports = up.child_pids(), up.child_ports()
    assert len(pids) == 4 and len(ports) >= 4
    up.popen.send_signal(signal.SIGKILL)
    up.popen.wait(10)
    wait_until(lambda: all(map(is_gone, pids)), GONE_TIMEOUT_S, "every service to exit with the launcher")
    wait_until(lambda: all(map(is_free, ports)), GONE_TIMEOUT_S, "every port to be free")


@pytest.fixture(scope="module")
def autoscaled_up(tiny_checkpoint, tmp_path_factory):
    """--autoscale with one warm worker, and one restart allowed per service (in 10 minutes: however slow the
    machine, the next test's kill lands in the window of the first test's)."""
    up = start_flotilla_up(tiny_checkpoint, tmp_path_factory.mktemp("autoscaled") / "state", "--autoscale",
                           "--min-workers", "1", "--max-workers", "2", "--warm-workers", "1",
                           model_name=MODEL, max_restarts=1, restart_window_s=600)
    yield up
    up.stop()


def test_a_worker_the_autoscaler_started_is_restarted_and_stays_warm(autoscaled_up):
    up = autoscaled_up
    warm = rpb.WORKER_STATE_WARM
    wait_until(lambda: (w := up.router_workers().get("worker-1")) and w.healthy and w.state == warm, 120,
               "the autoscaler to start a warm worker-1")
    pid = up.kill("worker-1")
    up.wait_said("worker-1 is serving again")
    assert up.pid("worker-1") != pid
    wait_until(lambda: (w := up.router_workers().get("worker-1")) and w.healthy, 30, "worker-1 registered again")
    assert up.router_workers()["worker-1"].state == warm  # out of rotation, as the autoscaler left it


def test_a_service_that_keeps_crashing_stops_the_fleet(autoscaled_up):
    up = autoscaled_up
    assert up.status()["services"]["worker-1"]["restarts"] == 1  # the one allowed (the test above)
    up.kill("worker-1")
    assert up.popen.wait(60) == 1
    said = up.stderr
    assert "worker-1 keeps crashing: it exited (killed by SIGKILL) 2 times within 600 s; stopping the fleet." in said
    assert f"The last lines of {up.state_dir / 'logs' / 'worker-1.log'}:" in said
    assert "flotilla worker listening on" in said.split("keeps crashing")[1]  # the log's tail, quoted
    pids, ports = up.child_pids(), up.child_ports()  # as the launcher last wrote them
    wait_until(lambda: all(map(is_gone, pids)), GONE_TIMEOUT_S, "every service to be stopped")
    wait_until(lambda: all(map(is_free, ports)), GONE_TIMEOUT_S, "every port to be free")
