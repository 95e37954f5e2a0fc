"""Structured outputs through the fleet with the real SDKs: `chat.completions.parse` and `messages.parse` with
pydantic models on the trained model (sensible values), streamed JSON, vLLM's guided_* extensions on the tiny
random model (the grammar, not the model, guarantees the shape), and bad schemas as 400s naming the field."""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from flotilla.models.catalog import DEFAULT_MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France? Reply with the city and its country."}]


class Capital(BaseModel):
    city: str
    country: str


@pytest.fixture
def trained_openai(trained_fleet):
    return openai.OpenAI(base_url=f"{trained_fleet.url}/v1", api_key=trained_fleet.api_key, max_retries=0)


def test_openai_parse_with_a_pydantic_model(trained_openai):
    completion = trained_openai.chat.completions.parse(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=40,
                                                       temperature=0, response_format=Capital)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.parsed == Capital.model_validate_json(choice.message.content)
    assert choice.message.parsed.city == "Paris"


def test_openai_streamed_json_object_parses(trained_openai):
    stream = trained_openai.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=60,
                                                    temperature=0, stream=True,
                                                    response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_anthropic_parse_with_a_pydantic_model(trained_fleet):
    client = anthropic.Anthropic(base_url=trained_fleet.url, api_key=trained_fleet.api_key, max_retries=0)
    message = client.messages.parse(model=DEFAULT_MODEL, max_tokens=40, messages=QUESTION, output_format=Capital,
                                    extra_body={"temperature": 0})  # this SDK's parse() takes no temperature
    assert message.stop_reason == "end_turn"
    assert isinstance(message.parsed_output, Capital) and message.parsed_output.city == "Paris"


BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "string", "maxLength": 4},
                                            "n": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
           "required": ["ok", "code", "n"], "additionalProperties": False}


@pytest.mark.parametrize("extra, check", [
    ({"guided_json": BOUNDED}, lambda text: jsonschema.validate(json.loads(text), BOUNDED) is None),
    ({"guided_regex": r"[A-Z]{2}[0-9]{3}"}, lambda text: re.fullmatch(r"[A-Z]{2}[0-9]{3}", text)),
    ({"guided_choice": ["left", "right"]}, lambda text: text in ("left", "right")),
    ({"structured_outputs": {"grammar": 'start: "<" /[a-c]+/ ">"'}}, lambda text: re.fullmatch(r"<[a-c]+>", text)),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_vllm_guided_extensions_on_the_random_model(fleet, extra, check, temperature):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0)
    completion = client.completions.create(model=fleet.model, prompt="Tell me something.", max_tokens=120,
                                           temperature=temperature, seed=5, extra_body=extra)
    assert completion.choices[0].finish_reason == "stop"
    assert check(completion.choices[0].text), completion.choices[0].text


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"extra_body": {"guided_regex": "[unclosed"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
])
def test_bad_specs_are_400s_naming_the_field(fleet, kwargs, param):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=fleet.model, messages=QUESTION, max_tokens=8, **kwargs)
    assert err.value.body["param"] == param


def test_anthropic_bad_schema_is_a_400(fleet):
    client = anthropic.Anthropic(base_url=fleet.url, api_key=fleet.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=fleet.model, max_tokens=8, messages=QUESTION,
                               output_config={"format": {"type": "json_schema", "schema": {"type": "bogus"}}})
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in err.value.body["error"]["message"]
