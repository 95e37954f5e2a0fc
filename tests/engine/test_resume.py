"""A stream resumed on another engine (the prompt and the tokens already delivered, NewRequest) continues
exactly: the same tokens (greedy, and seeded sampling: the sampler's seeds continue at index N),
and the same text, with the held-back tail of a stop string or a split character carried across the seam."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 2, 7], [3, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48]]
MAX_TOKENS = 14


class Run(NamedTuple):
    token_ids: list[int]
    deltas: list[str]  # text released with each token
    finish_reason: str | None
    stop_reason: object


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), num_kv_blocks=256))


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams, delivered: list[int] = ()) -> Run:
    request_id = f"r{id(prompt)}-{len(delivered)}-{params.seed}-{params.temperature}-{len(params.stop)}"
    engine.add_request(NewRequest(request_id, tuple(prompt), params, delivered_token_ids=tuple(delivered)))
    run = Run([], [], None, None)
    while True:
        for output in engine.step():
            if output.request_id != request_id:
                continue
            run.token_ids.extend(output.new_token_ids)
            run.deltas.append(output.text_delta)
            if output.finished:
                return run._replace(finish_reason=output.finish_reason.value, stop_reason=output.stop_reason)


def _resumed(engine: LLMEngine, prompt: list[int], params: SamplingParams, full: Run, cut: int) -> Run:
    rest = SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens - cut})
    return _run(engine, prompt, rest, delivered=full.token_ids[:cut])


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
], ids=["greedy", "seeded", "seeded-top-k"])
def test_resume_at_every_cut_continues_the_same_tokens_and_text(engine, params):
    for prompt in PROMPTS:
        full = _run(engine, prompt, params)
        assert len(full.token_ids) == MAX_TOKENS
        for cut in range(1, MAX_TOKENS):
            resumed = _resumed(engine, prompt, params, full, cut)
            assert resumed.token_ids == full.token_ids[cut:], (prompt, cut)
            assert "".join(full.deltas[:cut]) + "".join(resumed.deltas) == "".join(full.deltas), (prompt, cut)
            assert resumed.finish_reason == "length"
    assert engine.check_integrity()


def test_unseeded_sampling_resumes_with_the_request_id_seed(engine):
    # Without a seed the seed comes from (engine seed, request id): the router resumes under the same id.
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    engine.add_request(NewRequest("same-id", tuple(PROMPTS[0]), params))
    full = []
    while len(full) < 8:
        full += [t for o in engine.step() for t in o.new_token_ids]
    rest = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    engine.add_request(NewRequest("same-id", tuple(PROMPTS[0]), rest, delivered_token_ids=tuple(full[:3])))
    resumed = []
    while len(resumed) < 5:
        resumed += [t for o in engine.step() for t in o.new_token_ids]
    assert resumed == full[3:]


def test_stop_string_across_the_seam(engine):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    full = _run(engine, PROMPTS[1], greedy)
    text = "".join(full.deltas)
    # A stop string made of the text of tokens 4..7: it completes at token 7, its head arrives earlier.
    prefix_len = len(engine.tokenizer.decode(full.token_ids[:4]))
    stop = engine.tokenizer.decode(full.token_ids[:8])[prefix_len:]
    if not stop.strip() or text.find(stop) != prefix_len:
        pytest.skip("the tiny model's text at tokens 4..7 is not a usable stop string")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=(stop,))
    stopped = _run(engine, PROMPTS[1], params)
    assert stopped.stop_reason == stop
    for cut in range(1, len(stopped.token_ids)):
        resumed = _resumed(engine, PROMPTS[1], params, stopped, cut)
        assert resumed.token_ids == stopped.token_ids[cut:]
        assert resumed.stop_reason == stop
        assert "".join(stopped.deltas[:cut]) + "".join(resumed.deltas) == "".join(stopped.deltas)


def test_a_resumed_request_without_its_own_prompt_is_refused(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(NewRequest("bad", (), SamplingParams(max_tokens=2), delivered_token_ids=(1, 2, 3)))
    assert err.value.field == "prompt"
