"""Tool calling through the real fleet (router, worker, gateway processes) with the real SDKs, on a checkpoint whose
greedy answer is one Hermes tool call (tests/support/scripted_checkpoint.py): the worker's engine really writes
`<tool_call>{...}</tool_call>`, the gateway reads it back as OpenAI tool_calls and Anthropic tool_use, streamed and
not; the tool result goes back through the chat template; count_tokens equals the usage of the same request."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from flotilla.engine.tokenizer import Tokenizer

from tests.support.fleet import Fleet, fleet_config, start_fleet
from tests.support.scripted_checkpoint import write_scripted_checkpoint

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted_checkpoint(tiny_checkpoint: Path, tmp_path_factory) -> Path:
    return write_scripted_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("scripted") / "ckpt")


@pytest.fixture(scope="module")
def tool_fleet(scripted_checkpoint: Path, tmp_path_factory) -> Fleet:
    config = fleet_config(scripted_checkpoint, tmp_path_factory.mktemp("tool-fleet"),
                          worker_args=["--num-kv-blocks", "128"])
    with start_fleet(config, keys={"test-key": ("tenant-a", "paid")}) as running:
        yield running


@pytest.fixture(scope="module")
def oai(tool_fleet):
    return openai.OpenAI(base_url=f"{tool_fleet.url}/v1", api_key=tool_fleet.api_key, max_retries=0)


@pytest.fixture(scope="module")
def claude(tool_fleet):
    return anthropic.Anthropic(base_url=tool_fleet.url, api_key=tool_fleet.api_key, max_retries=0)


def test_openai_tool_calls(oai, tool_fleet, scripted_checkpoint):
    r = oai.chat.completions.create(model=tool_fleet.model, messages=QUESTION, tools=[WEATHER], max_tokens=16,
                                    temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = Tokenizer.from_pretrained(scripted_checkpoint).encode_chat(QUESTION, tools=[WEATHER])
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4  # 3 tool-call tokens + eos


def test_openai_tool_calls_streamed(oai, tool_fleet):
    stream = oai.chat.completions.create(model=tool_fleet.model, messages=QUESTION, tools=[WEATHER], max_tokens=16,
                                         temperature=0, stream=True)
    content, arguments, names, finish = "", "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                names += call.function.name or ""
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert content == "" and names == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert finish == "tool_calls"


def test_anthropic_tool_use_round_trip(claude, tool_fleet, scripted_checkpoint):
    first = claude.messages.create(model=tool_fleet.model, max_tokens=16, messages=QUESTION,
                                   tools=[ANTHROPIC_WEATHER], extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    history = [*QUESTION, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}]
    count = claude.messages.count_tokens(model=tool_fleet.model, messages=history, tools=[ANTHROPIC_WEATHER])
    second = claude.messages.create(model=tool_fleet.model, max_tokens=16, messages=history,
                                    tools=[ANTHROPIC_WEATHER], extra_body={"temperature": 0})
    # The tools and question are cached from the first request: Anthropic counts those reads apart.
    assert count.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    expected = Tokenizer.from_pretrained(scripted_checkpoint).encode_chat(
        [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "18 C, sunny", "tool_call_id": use.id, "name": "get_weather"}], tools=[WEATHER])
    assert count.input_tokens == len(expected)
    # This model calls the tool again whatever it is told; what matters is that the history went through.
    assert second.stop_reason == "tool_use" and second.content[0].input == {"city": "Paris"}


def test_anthropic_tool_use_streamed(claude, tool_fleet):
    with claude.messages.stream(model=tool_fleet.model, max_tokens=16, messages=QUESTION,
                                tools=[ANTHROPIC_WEATHER], extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"]
    assert json.loads(deltas[0].partial_json) == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}


def test_count_tokens_equals_usage_without_tools(claude, tool_fleet):
    messages = [{"role": "user", "content": "A question never asked before: how far is the moon?"}]
    count = claude.messages.count_tokens(model=tool_fleet.model, system="Answer briefly.", messages=messages)
    reply = claude.messages.create(model=tool_fleet.model, system="Answer briefly.", messages=messages,
                                   max_tokens=4, extra_body={"temperature": 0})
    assert reply.usage.cache_read_input_tokens == 0 and count.input_tokens == reply.usage.input_tokens
