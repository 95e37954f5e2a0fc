"""Sampling, stop conditions, aborts and bad input through the engine's public API."""

from __future__ import annotations

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.request import FinishReason
from flotilla.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(reference) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=reference.model_dir, num_kv_blocks=256))


def _state(engine: LLMEngine):
    stats = engine.stats()
    return stats.num_running, stats.num_waiting, stats.num_free_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent(engine, reference):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = engine.generate([reference.prompts[0]], params)[0].token_ids
    crowd = engine.generate(reference.prompts[:6], [params] + [SamplingParams(max_tokens=20, temperature=0.8)] * 5)
    assert crowd[0].token_ids == alone
    other_seed = engine.generate([reference.prompts[0]], SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_is_greedy(engine, reference):
    greedy = engine.generate([reference.prompts[1]], SamplingParams(max_tokens=10, temperature=0.0))[0]
    top1 = engine.generate([reference.prompts[1]], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3))[0]
    assert top1.token_ids == greedy.token_ids


def test_max_tokens_finishes_with_length(engine, reference):
    result = engine.generate([reference.prompts[2]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(result.token_ids) == 5 and result.finish_reason is FinishReason.LENGTH


def test_stop_token_id_finishes_with_stop(engine, reference):
    free_run = engine.generate([reference.prompts[3]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    result = engine.generate(
        [reference.prompts[3]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True)
    )[0]
    assert result.token_ids == free_run.token_ids[: first + 1]
    assert result.finish_reason is FinishReason.STOP


def test_stop_string_cuts_text_and_is_never_streamed(engine, reference):
    free_run = engine.generate([reference.prompts[4]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = free_run.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,), ignore_eos=True)
    engine.add_request(NewRequest("stop-str", tuple(reference.prompts[4]), params))
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed += output.text_delta
            assert stop not in streamed
            if output.finished:
                final = output
    assert streamed == text[: text.index(stop)]
    assert final.finish_reason is FinishReason.STOP and final.stop_reason == stop


def test_streamed_text_equals_decode_of_tokens(engine, reference):
    result = engine.generate([reference.prompts[5]], SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True))[0]
    assert result.text == engine.tokenizer.decode(result.token_ids)


def test_logprobs_are_returned_when_asked(engine, reference):
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    engine.add_request(NewRequest("lp", tuple(reference.prompts[0]), params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    for output in outputs:
        (entry,) = output.logprobs
        assert entry.logprob <= 0.0 and len(entry.top) == 2
        assert entry.top[0][0] == output.new_token_ids[0]  # greedy: the sampled token is the most likely


def test_abort_frees_blocks_at_once(engine, reference):
    params = SamplingParams(max_tokens=50, temperature=0.0)
    engine.add_request(NewRequest("to-abort", tuple(reference.prompts[6]), params))
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
    assert engine.abort("to-abort")
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    assert not engine.has_unfinished_requests()
    assert not engine.abort("to-abort")
    assert engine.check_integrity()


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(max_tokens=4), "prompt"),
        ([1, 2, -3], SamplingParams(max_tokens=4), "prompt"),
        ([1, 2, 10**9], SamplingParams(max_tokens=4), "prompt"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=-5), "max_tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=10**7), "max_tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
        ([1, 2, 3], SamplingParams(max_tokens=4, temperature=float("nan")), "temperature"),
        ([1, 2, 3], SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
        ([1, 2, 3], SamplingParams(max_tokens=4, top_p=1.5), "top_p"),
        ([1, 2, 3], SamplingParams(max_tokens=4, top_k=-1), "top_k"),
        ([1, 2, 3], SamplingParams(max_tokens=4, stop=("",)), "stop"),
        ([1, 2, 3], SamplingParams(max_tokens=4, logprobs=99), "logprobs"),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(engine, prompt, params, field):
    before = _state(engine)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(NewRequest("bad", tuple(prompt), params))
    assert error.value.field == field
    assert _state(engine) == before
    assert not engine.has_unfinished_requests()


def test_prompt_beyond_context_window_names_the_numbers(engine):
    limit = engine.max_model_len
    before = _state(engine)
    with pytest.raises(ContextLengthError) as error:
        engine.add_request(NewRequest("long", (1,) * (limit - 10), SamplingParams(max_tokens=20)))
    message = str(error.value)
    assert str(limit - 10) in message and "20" in message and str(limit) in message
    with pytest.raises(ContextLengthError):
        engine.add_request(NewRequest("longer", (1,) * (limit + 1), SamplingParams(max_tokens=1)))
    assert _state(engine) == before


def test_duplicate_request_id_is_refused(engine, reference):
    engine.add_request(NewRequest("dup", tuple(reference.prompts[0]), SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(NewRequest("dup", tuple(reference.prompts[0]), SamplingParams(max_tokens=2)))
    assert error.value.field == "request_id"
    engine.abort("dup")
