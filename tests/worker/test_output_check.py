"""The golden-output check on a real engine: it passes on the weights it recorded, while other requests run,
and fails when a weight changes under the running engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.worker.check_settings import CheckSettings
from flotilla.worker.output_check import OutputCheck

from tests.support.engines import engine_config


@pytest.fixture
async def engine(tiny_checkpoint):
    # Its own engine: the tests corrupt its weights.
    engine = AsyncEngine(lambda: LLMEngine(engine_config(tiny_checkpoint)))
    await engine.start()
    yield engine
    await engine.shutdown()


async def _background_requests(engine: AsyncEngine, count: int) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in await engine.generate(NewRequest(f"bg-{i}", tuple(range(5 + i, 40 + i)), params)):
            pass

    await asyncio.gather(*(one(i) for i in range(count)))


async def test_passes_on_unchanged_weights_alone_and_batched_with_other_requests(engine):
    check = OutputCheck(engine)
    golden = await check.record()
    assert len(golden.token_ids) >= 4 and len(golden.logprobs) == len(golden.token_ids)
    assert await check.check_once()
    background = asyncio.create_task(_background_requests(engine, 6))
    results = [await check.check_once() for _ in range(3)]
    await background
    assert results == [True] * 3 and check.failure == "" and check.num_checks == 4


def _weight(engine: AsyncEngine) -> torch.Tensor:
    """A weight every step reads as a dense tensor: on a CPU the linears' weights are packed for oneDNN
    (model/cpu_linear.py), opaque to in-place edits."""
    return engine.engine.runner.model.model.layers[0].post_attention_layernorm.weight


@pytest.mark.parametrize("corruption, why", [
    (lambda w: w.mul_(-1.0), "token"),  # a gross fault: the answer changes
    (lambda w: w.mul_(1.02), "logprob"),  # a small one: logprobs move before tokens flip
])
async def test_fails_when_a_weight_changes_and_stays_failed(engine, corruption, why):
    results = []
    check = OutputCheck(engine, CheckSettings(logprob_tolerance=0.001), on_result=results.append)
    await check.record()
    with torch.no_grad():
        await engine.call(lambda _: corruption(_weight(engine)))
    assert not await check.check_once()
    assert check.failure.startswith(f"output check failed: {why}") or why in check.failure
    first = check.failure
    await check.check_once()
    assert check.failure == first  # sticky: the first reason stays


async def test_run_forever_reports_each_check(engine):
    results: list[str] = []
    check = OutputCheck(engine, CheckSettings(interval_s=0.01), on_result=results.append)
    await check.record()
    task = asyncio.create_task(check.run_forever())
    while len(results) < 2:
        await asyncio.sleep(0.01)
    with torch.no_grad():
        await engine.call(lambda _: _weight(engine).mul_(-1.0))
    while "fail" not in results:
        await asyncio.sleep(0.01)
    task.cancel()
    assert results[:2] == ["pass", "pass"] and check.failure
