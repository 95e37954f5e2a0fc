"""The fixed-batch backend's contract (worker/fixed_batch/): loading run_batch by import path, the checks on what
it returns, the simulated accelerator's transform, and the engine run_batch: each output is what the engine
answers that input alone, greedy."""

from __future__ import annotations

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.worker.fixed_batch.contract import (ENGINE, SIMULATED, BatchOptions, ContractError, checked_call,
                                                  load_run_batch)
from flotilla.worker.fixed_batch.simulated import SimulatedAccelerator, transform


def upper(inputs: list[str]) -> list[str]:
    return [text.upper() for text in inputs]


def test_an_import_path_names_a_plain_run_batch_or_a_factory():
    assert load_run_batch(f"{__name__}:upper", BatchOptions()) is upper
    simulated = load_run_batch(SIMULATED, BatchOptions(max_batch_size=7, batch_latency_ms=0))
    assert isinstance(simulated, SimulatedAccelerator) and simulated.max_batch_size == 7
    assert simulated(["ab", "ba"]) == [transform("ab"), transform("ba")]
    with pytest.raises(ValueError, match="MODULE:NAME"):
        load_run_batch("no_colon", BatchOptions())


def test_the_simulated_transform_tells_inputs_apart():
    outputs = {transform(f"input {i}") for i in range(10_000)}
    assert len(outputs) == 10_000
    assert transform("abc").startswith("cba#")


def test_outputs_that_break_the_contract_are_refused():
    with pytest.raises(ContractError, match="2 outputs for 3 inputs"):
        checked_call(lambda inputs: inputs[:2], ["a", "b", "c"], 50)
    with pytest.raises(ContractError, match="non-string"):
        checked_call(lambda inputs: [1 for _ in inputs], ["a"], 50)
    with pytest.raises(ContractError, match="1 to 2 inputs"):
        checked_call(upper, ["a", "b", "c"], 2)
    with pytest.raises(ContractError, match="1 to 2 inputs"):
        SimulatedAccelerator(2, 0.0)([])


def test_the_engine_run_batch_answers_each_input_as_the_engine_answers_it_alone(tiny_checkpoint):
    run_batch = load_run_batch(ENGINE, BatchOptions(max_batch_size=4, model_dir=str(tiny_checkpoint), max_tokens=6,
                                                    device="cpu"))
    inputs = ["hello there", "a b c", "the same prompt", "zz"]
    outputs = checked_call(run_batch, inputs, 4)
    alone = LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), device="cpu"))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    assert outputs == [alone.generate([text], greedy)[0].text for text in inputs]
    assert run_batch.model_version == alone.model_version
