"""Failures during a KV hand-off, on a real disaggregated fleet (1 prefill + 1 decode worker, long prompts in
32-token chunks so that a transfer lasts many steps): a client cancel, kill -9 of the prefill worker, kill -9
of the decode worker. Afterwards check_integrity() holds on every surviving worker and no block is held."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.fleet.local import LocalFleet

from tests.support.fleet import num_healthy_workers

from .fleet_helpers import MODEL, NUM_KV_BLOCKS, assert_clean, fleet_config, kv_state, until, workers_with_role

CHUNK = 32


def _long_text(tag: str) -> str:
    """A distinct ~1.3k-token prompt per test: no prefix-cache hit turns its transfer into a local prefill."""
    return f"{tag} harbour log: " + " ".join(f"tide{i % 97} knot{i % 13}" for i in range(260))


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint: Path, tmp_path_factory):
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("disagg-failures"), 1, 1,
                          "--max-num-batched-tokens", str(CHUNK), "--kv-lease-s", "5")  # fmt: skip
    config.router_args = ["--max-queue-wait-s", "2"]  # once the decode worker is dead, fail fast
    with LocalFleet(config) as local_fleet:
        yield local_fleet


@pytest.fixture(scope="module")
def expected(tiny_checkpoint: Path):
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), num_kv_blocks=NUM_KV_BLOCKS,
                                    max_num_batched_tokens=CHUNK))  # fmt: skip

    def text_for(prompt_text: str) -> str:
        prompt = engine.tokenizer.encode(prompt_text)
        if not 1000 < len(prompt) < 2000:
            raise ValueError(f"the long prompt should be 1000..2000 tokens, is {len(prompt)}")
        return engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].text

    return text_for


def _complete(fleet: LocalFleet, text: str):
    client = openai.AsyncOpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)


def _in_flight(prefill, decode) -> bool:
    return kv_state(decode).num_incoming_transfers >= 1 and kv_state(prefill).num_outgoing_transfers >= 1


def test_cancel_during_transfer_frees_both_sides(fleet, expected):
    (prefill,), (decode,) = workers_with_role(fleet, "prefill"), workers_with_role(fleet, "decode")

    async def cancel_mid_transfer():
        task = asyncio.create_task(_complete(fleet, _long_text("cancelled")))
        await asyncio.to_thread(until, lambda: _in_flight(prefill, decode), 30, "a transfer in flight")
        task.cancel()  # closes the HTTP connection: gateway -> router -> decode worker -> prefill worker
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_transfer())
    assert_clean([prefill, decode])
    text = _long_text("after cancel")
    assert asyncio.run(_complete(fleet, text)).choices[0].text == expected(text)  # and the pair still works


def test_kill_prefill_worker_mid_transfer_places_again(fleet, expected):
    (prefill,), (decode,) = workers_with_role(fleet, "prefill"), workers_with_role(fleet, "decode")
    fallbacks = kv_state(decode).num_local_fallbacks
    text = _long_text("prefill killed")

    async def kill_mid_transfer():
        task = asyncio.create_task(_complete(fleet, text))
        await asyncio.to_thread(until, lambda: _in_flight(prefill, decode), 30, "a transfer in flight")
        prefill.kill()
        return await task

    response = asyncio.run(kill_mid_transfer())
    assert response.choices[0].text == expected(text)  # prefilled again, on the decode worker
    assert kv_state(decode).num_local_fallbacks == fallbacks + 1
    assert_clean([decode])
    fleet.start_worker(extra_args=["--role", "prefill"])  # for the next test


def test_kill_decode_worker_mid_transfer_frees_prefill_side(fleet):
    (prefill,) = until(lambda: workers_with_role(fleet, "prefill"), 60, "a prefill worker")
    (decode,) = workers_with_role(fleet, "decode")
    until(lambda: _registered(fleet, 2), 60, "the new prefill worker to register")

    async def kill_mid_transfer():
        task = asyncio.create_task(_complete(fleet, _long_text("decode killed")))
        await asyncio.to_thread(until, lambda: _in_flight(prefill, decode), 30, "a transfer in flight")
        decode.kill()
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            await task

    asyncio.run(kill_mid_transfer())
    assert_clean([prefill])


def _registered(fleet: LocalFleet, count: int) -> bool:
    return num_healthy_workers(fleet.router_address) >= count
