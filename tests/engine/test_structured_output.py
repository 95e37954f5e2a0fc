"""Constrained decoding on the tiny random model: whatever the weights, the output follows the schema, regex,
choice list or grammar, batched with unconstrained requests, sampled or greedy, and across a stream resume."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.request import FinishReason
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.structured_output import StructuredOutput, any_json_object

NUM_SCHEMAS = 12


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), num_kv_blocks=512, block_size=16))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Bounded schemas (strings, arrays and nesting capped) so that every output completes within max_tokens."""
    kinds = ["string", "integer", "boolean", "enum", "number"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        return {"type": "integer", "minimum": -50, "maximum": 50}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 1}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 3, None, True], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["id", "name", "tags", "score", "ok", "child", "when"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


def _params(structured: StructuredOutput, seed: int | None, max_tokens: int = 400) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, structured_output=structured)


def _object_schemas() -> list[dict]:
    rng = random.Random(7)
    schemas = []
    while len(schemas) < NUM_SCHEMAS:
        schema = random_schema(rng)
        if schema.get("type") == "object":
            schemas.append(schema)
    return schemas


def test_outputs_validate_against_random_schemas_batched_with_free_requests(engine):
    schemas = _object_schemas()
    free_params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 40 + i, 7] for i in range(NUM_SCHEMAS)]
    (free_alone,) = engine.generate([prompts[0]], free_params)
    params = [_params(StructuredOutput("json", json.dumps(s)), seed=None if i % 2 else i)
              for i, s in enumerate(schemas)]
    results = engine.generate([*prompts, prompts[0]], [*params, free_params])
    for schema, result in zip(schemas, results):
        assert result.finish_reason is FinishReason.STOP, result.text
        jsonschema.validate(json.loads(result.text), schema)
    # The masks touch only their own rows: the unconstrained request is the same as when it ran alone.
    assert results[-1].token_ids == free_alone.token_ids
    assert engine.check_integrity()


def test_any_json_object_parses_or_is_cut_by_max_tokens(engine):
    results = engine.generate([[3, 4, 5], [6, 7, 8]], [_params(any_json_object(), seed=s, max_tokens=60) for s in (1, 2)])
    for result in results:
        if result.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(result.text), dict)
        else:  # an unbounded object: cut by max_tokens, a prefix of one
            assert result.finish_reason is FinishReason.LENGTH and result.text.startswith("{")


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput("regex", r"[a-z]{3}-[0-9]{2,4}"), lambda text: re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", text)),
    (StructuredOutput("choice", '["yes", "no", "maybe later"]'), lambda text: text in ("yes", "no", "maybe later")),
    (StructuredOutput("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'),
     lambda text: re.fullmatch(r"\([0-9](,[0-9])*\)", text)),
])
@pytest.mark.parametrize("seed", [None, 11, 12])
def test_regex_choice_and_grammar(engine, spec, check, seed):
    (result,) = engine.generate([[9, 10, 11, 12]], _params(spec, seed, max_tokens=200))
    assert check(result.text), result.text
    assert result.finish_reason is FinishReason.STOP


def test_a_resumed_stream_continues_inside_the_grammar(engine):
    schema = _object_schemas()[0]
    spec = StructuredOutput("json", json.dumps(schema))
    prompt = [21, 22, 23]
    (whole,) = engine.generate([prompt], _params(spec, seed=None))
    half = len(whole.token_ids) // 2
    assert half > 0
    resumed = NewRequest("resumed", tuple(prompt), _params(spec, seed=None, max_tokens=400 - half),
                         delivered_token_ids=tuple(whole.token_ids[:half]))
    engine.add_request(resumed)
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            rest += output.new_token_ids
    assert whole.token_ids[:half] + rest == whole.token_ids


@pytest.mark.parametrize("spec, why", [
    (StructuredOutput("json", '{"type": "nonsense"}'), "invalid json"),
    (StructuredOutput("json", "{not json"), "invalid json"),
    (StructuredOutput("regex", "[unclosed"), "invalid regex"),
    (StructuredOutput("choice", "[]"), "non-empty list"),
    (StructuredOutput("grammar", "start: undefined_rule"), "invalid grammar"),
])
def test_invalid_specs_are_refused_before_anything_runs(engine, spec, why):
    with pytest.raises(InvalidRequestError, match=why) as err:
        engine.add_request(NewRequest("bad", (1, 2, 3), _params(spec, seed=None)))
    assert err.value.field == "structured_output"
    assert not engine.has_unfinished_requests()


def test_delivered_tokens_outside_the_grammar_are_refused(engine):
    not_json = tuple(engine.tokenizer.encode("hello", add_special_tokens=False))
    with pytest.raises(InvalidRequestError, match="does not follow"):
        engine.add_request(NewRequest("bad-resume", (1, 2), _params(any_json_object(), None), delivered_token_ids=not_json))
