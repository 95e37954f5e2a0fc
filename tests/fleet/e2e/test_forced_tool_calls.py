"""tool_choice that forces a call (OpenAI required / a named function, Anthropic any / tool) on the tiny random
model with a Hermes template: left alone it writes noise, forced it writes calls that parse, name an offered
tool and carry arguments that validate against that tool's parameters (the grammar, not the model, ensures it)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from tests.support.fleet import Fleet, fleet_config, start_fleet
from tests.support.tool_templates import with_chat_template

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "forecast", "description": "Forecast", "parameters": DAYS}}]
SCHEMAS = {"get_weather": CITY, "forecast": DAYS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def forced_fleet(tiny_checkpoint: Path, tmp_path_factory) -> Fleet:
    checkpoint = with_chat_template(tiny_checkpoint, tmp_path_factory.mktemp("hermes") / "ckpt")
    config = fleet_config(checkpoint, tmp_path_factory.mktemp("forced-fleet"), worker_args=["--num-kv-blocks", "128"])
    with start_fleet(config, keys={"k": ("tenant-t", "paid")}) as running:
        yield running


@pytest.fixture(scope="module")
def oai(forced_fleet):
    return openai.OpenAI(base_url=f"{forced_fleet.url}/v1", api_key=forced_fleet.api_key, max_retries=0)


def _check(name: str, arguments: str, expected_name: str | None) -> None:
    assert name in SCHEMAS and (expected_name is None or name == expected_name)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice, expected", [
    ("required", None), ({"type": "function", "function": {"name": "forecast"}}, "forecast")])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_openai_forced_calls(oai, forced_fleet, tool_choice, expected, seed):
    r = oai.chat.completions.create(model=forced_fleet.model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                    parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check(call.function.name, call.function.arguments, expected)


def test_openai_forced_call_streamed(oai, forced_fleet):
    stream = oai.chat.completions.create(model=forced_fleet.model, messages=QUESTION, tools=TOOLS, max_tokens=80,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         parallel_tool_calls=False, temperature=0, stream=True)
    name, arguments, finish = None, "", None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                name = delta.function.name or name
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    _check(name, arguments, "get_weather")


@pytest.mark.parametrize("tool_choice, expected", [
    ({"type": "any", "disable_parallel_tool_use": True}, None), ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, "get_weather")])
def test_anthropic_forced_calls(forced_fleet, tool_choice, expected):
    client = anthropic.Anthropic(base_url=forced_fleet.url, api_key=forced_fleet.api_key, max_retries=0)
    tools = [{"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    message = client.messages.create(model=forced_fleet.model, max_tokens=80, messages=QUESTION, tools=tools,
                                     tool_choice=tool_choice)
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and all(_check(c.name, json.dumps(c.input), expected) is None for c in calls)


@pytest.mark.parametrize("kwargs, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_forced_calls_refused_naming_the_field(oai, forced_fleet, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=forced_fleet.model, messages=QUESTION, tools=TOOLS, max_tokens=8, **kwargs)
    assert err.value.body["param"] == param


def test_required_without_tools_is_refused(oai, forced_fleet):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=forced_fleet.model, messages=QUESTION, max_tokens=8, tool_choice="required")
    assert err.value.body["param"] == "tool_choice"
