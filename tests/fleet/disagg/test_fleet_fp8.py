"""A disaggregated fleet with fp8 KV caches (1 prefill + 1 decode worker, real processes, KV over NIXL): both
workers calibrate the same scales, so blocks the prefill worker wrote decode as a colocated fp8 engine's do. A
decode worker whose cache format differs (unit scales) is refused by the prefill worker before any write, and
prefills its requests itself."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.fleet.local import LocalFleet
from loadtest.common.greedy_compare import greedy_with_logprobs

from tests.support.fleet import num_healthy_workers

from .fleet_helpers import MAX_BATCHED_TOKENS, MODEL, NUM_KV_BLOCKS, assert_clean, fleet_config, kv_state, until, workers_with_role

FP8 = ("--kv-cache-dtype", "float8_e4m3fn")
PROMPTS = [f"Entry {i}: " + " ".join(f"tide{(i * 5 + k) % 17} sail{k % 5}" for k in range(20 + 15 * i))
           for i in range(4)]  # ~60 to ~240 tokens: every one prefilled remotely
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint: Path, tmp_path_factory):
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("disagg-fp8"), 1, 1, *FP8)
    with LocalFleet(config) as local_fleet:
        yield local_fleet


def _reference(checkpoint: Path, scales: str) -> list[tuple[list[int], list[float]]]:
    """Per prompt: a colocated fp8 engine's greedy tokens and their log-probabilities."""
    engine = LLMEngine(EngineConfig(model_dir=str(checkpoint), kv_cache_dtype=FP8[1], kv_cache_scales=scales,
                                    num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=MAX_BATCHED_TOKENS))
    # One prompt at a time, as the fleet gets them: fp8 rounding turns the float noise of another batch shape
    # into visible logprob differences.
    runs = [greedy_with_logprobs(engine, [engine.tokenizer.encode(prompt)], MAX_TOKENS, ignore_eos=True)
            for prompt in PROMPTS]
    return [(token_ids[0], logprobs[0]) for token_ids, logprobs in runs]


def _complete_all(fleet: LocalFleet) -> list[list[float]]:
    """Per prompt: the fleet's greedy tokens' log-probabilities."""
    client = openai.OpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)
    choices = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True}).choices[0] for prompt in PROMPTS]
    return [choice.logprobs.token_logprobs for choice in choices]


def _assert_same(fleet_logprobs, reference) -> None:
    for ours, (_, theirs) in zip(fleet_logprobs, reference, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)


def test_fp8_hand_off_decodes_as_a_colocated_fp8_engine(fleet, tiny_checkpoint):
    (prefill,) = workers_with_role(fleet, "prefill")
    (decode,) = workers_with_role(fleet, "decode")
    _assert_same(_complete_all(fleet), _reference(tiny_checkpoint, "calibrate"))
    assert kv_state(prefill).num_transfers_completed >= len(PROMPTS)
    assert kv_state(decode).num_local_fallbacks == 0
    assert_clean(fleet.workers)


def test_a_decode_worker_with_other_scales_is_refused_and_prefills_itself(fleet, tiny_checkpoint):
    (prefill,) = workers_with_role(fleet, "prefill")
    (calibrated,) = workers_with_role(fleet, "decode")
    unit = fleet.start_worker(extra_args=["--role", "decode", "--kv-cache-scales", "unit"])
    until(lambda: num_healthy_workers(fleet.router_address) == 3, 60, "the second decode worker registered")
    fleet.retire_worker(calibrated.name)
    calibrated.stop()
    until(lambda: num_healthy_workers(fleet.router_address) == 2, 60, "the calibrated decode worker gone")
    completed_before = kv_state(prefill).num_transfers_completed

    _assert_same(_complete_all(fleet), _reference(tiny_checkpoint, "unit"))
    assert kv_state(unit).num_local_fallbacks == len(PROMPTS)
    assert kv_state(prefill).num_transfers_completed == completed_before  # nothing was written
    assert "caches KV as 'float8_e4m3fn" in (Path(fleet.config.state_dir) / "logs" / f"{unit.name}.log").read_text()
    assert_clean([prefill, unit])


def test_the_two_scales_settings_give_different_logprobs(tiny_checkpoint):
    """What makes the cases above able to tell a calibrated cache from a unit one."""
    calibrated, unit = _reference(tiny_checkpoint, "calibrate"), _reference(tiny_checkpoint, "unit")
    assert max(abs(a - b) for (_, x), (_, y) in zip(calibrated, unit) for a, b in zip(x, y)) > 1e-3
