"""Tool calling through the gateway with the real SDKs: the model's output is scripted (fake router model "script"),
so each test knows the exact tool-call text, split across chunks as a model would stream it; the prompt the router
receives is checked against the chat template's rendering of the tools and the history."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from flotilla.engine.tokenizer import Tokenizer

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANTHROPIC_WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                          "input_schema": WEATHER_TOOL["function"]["parameters"]}
# A Hermes-style answer, split as a model streams it: the marker and the JSON cut mid-token.
SCRIPT = ["I will", " check.", "\n", "<tool", "_call>", '\n{"name": "get_', 'weather", "arguments": {"ci',
          'ty": "Paris"}}\n</tool_', "call>"]
TWO_CALLS = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>']
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def oai(tool_gateway):
    tool_gateway.fake.script = list(SCRIPT)
    return openai.OpenAI(base_url=tool_gateway.base_url + "/v1", api_key=tool_gateway.paid_key, max_retries=0)


@pytest.fixture
def claude(tool_gateway):
    tool_gateway.fake.script = list(SCRIPT)
    return anthropic.Anthropic(base_url=tool_gateway.base_url, api_key=tool_gateway.paid_key, max_retries=0)


@pytest.fixture(scope="module")
def tool_tokenizer(tool_checkpoint_dir):
    return Tokenizer.from_pretrained(tool_checkpoint_dir)


def test_openai_tool_calls(oai, tool_gateway, tool_tokenizer):
    r = oai.chat.completions.create(model="script", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=50)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    sent = tool_gateway.fake.requests[-1]
    assert list(sent.prompt_token_ids) == tool_tokenizer.encode_chat(QUESTION, tools=[WEATHER_TOOL])
    assert "get_weather" in tool_tokenizer.decode(sent.prompt_token_ids)


def test_openai_tool_calls_streamed(oai):
    stream = oai.chat.completions.create(model="script", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=50,
                                         stream=True)
    text, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            assert "<" not in (delta.content or ""), delta.content  # no part of a marker leaks as text
            text += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert text == "I will check." and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_openai_stream_helper_assembles_the_calls(oai, tool_gateway):
    tool_gateway.fake.script = list(TWO_CALLS)
    with oai.chat.completions.stream(model="script", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=50) as s:
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert final.choices[0].message.content is None and final.choices[0].finish_reason == "tool_calls"


def test_openai_parallel_tool_calls_false_keeps_the_first(oai, tool_gateway):
    tool_gateway.fake.script = list(TWO_CALLS)
    r = oai.chat.completions.create(model="script", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=50,
                                    parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris"]


def test_openai_tool_results_render_through_the_template(oai, tool_gateway, tool_tokenizer):
    history = [*QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    tool_gateway.fake.script = ["It is 18 C", " and sunny."]
    r = oai.chat.completions.create(model="script", messages=history, tools=[WEATHER_TOOL], max_tokens=50)
    assert r.choices[0].message.content == "It is 18 C and sunny." and r.choices[0].finish_reason == "stop"
    rendered = tool_tokenizer.decode(tool_gateway.fake.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered


def test_openai_tool_choice_none_shows_no_tools_and_parses_nothing(oai, tool_gateway, tool_tokenizer):
    r = oai.chat.completions.create(model="script", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=50,
                                    tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "".join(SCRIPT)
    assert list(tool_gateway.fake.requests[-1].prompt_token_ids) == tool_tokenizer.encode_chat(QUESTION)


def test_anthropic_tool_use_round_trip(claude, tool_gateway, tool_tokenizer):
    first = claude.messages.create(model="script", max_tokens=50, messages=QUESTION, tools=[ANTHROPIC_WEATHER_TOOL])
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"] and first.content[0].text == "I will check."
    use = first.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    prompt = list(tool_gateway.fake.requests[-1].prompt_token_ids)
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == len(prompt)

    history = [*QUESTION, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    tool_gateway.fake.script = ["It is 18 C."]
    second = claude.messages.create(model="script", max_tokens=50, messages=history, tools=[ANTHROPIC_WEATHER_TOOL])
    assert second.stop_reason == "end_turn" and second.content[0].text == "It is 18 C."
    expected = tool_tokenizer.encode_chat(
        [*QUESTION, {"role": "assistant", "content": "I will check.", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "18 C", "tool_call_id": use.id, "name": "get_weather"}],
        tools=[WEATHER_TOOL])
    assert list(tool_gateway.fake.requests[-1].prompt_token_ids) == expected
    count = claude.messages.count_tokens(model="script", messages=history, tools=[ANTHROPIC_WEATHER_TOOL])
    assert count.input_tokens == len(expected)


def test_anthropic_tool_use_streamed(claude):
    with claude.messages.stream(model="script", max_tokens=50, messages=QUESTION,
                                tools=[ANTHROPIC_WEATHER_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    text_deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    json_deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert "".join(text_deltas) == "I will check." and not any("<" in t for t in text_deltas)
    assert len(json_deltas) == 1 and json_deltas[0].index == 1
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.content[1].name == "get_weather"


def test_anthropic_only_tool_calls_stream_no_text_block(claude, tool_gateway):
    tool_gateway.fake.script = list(TWO_CALLS)
    with claude.messages.stream(model="script", max_tokens=50, messages=QUESTION,
                                tools=[ANTHROPIC_WEATHER_TOOL]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use", "tool_use"]
    assert [b.input["city"] for b in final.content] == ["Paris", "Rome"]


def test_tools_on_a_model_whose_template_ignores_them_are_refused(gateway):
    """The plain ChatML template renders no tools: a 400 naming tools, not an answer that ignored them."""
    for path, body, headers in [
        ("/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 5, "tools": [WEATHER_TOOL]},
         {"authorization": f"Bearer {gateway.paid_key}"}),
        ("/v1/messages", {"model": "tiny", "messages": QUESTION, "max_tokens": 5,
                          "tools": [ANTHROPIC_WEATHER_TOOL]}, {"x-api-key": gateway.paid_key}),
        ("/v1/messages/count_tokens", {"model": "tiny", "messages": QUESTION, "tools": [ANTHROPIC_WEATHER_TOOL]},
         {"x-api-key": gateway.paid_key}),
    ]:
        response = httpx.post(gateway.base_url + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        assert "tools is not supported by this model" in response.text


def test_count_tokens_equals_the_prompt_the_router_gets(gateway, tokenizer):
    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.paid_key, max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]
    count = claude.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    reply = claude.messages.create(model="tiny", system="Be brief.", messages=messages, max_tokens=3)
    assert count.input_tokens == len(gateway.fake.requests[-1].prompt_token_ids)
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_count_tokens_refuses_what_messages_refuses(gateway):
    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.paid_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="thinking is not supported"):
        claude.messages.count_tokens(model="tiny", messages=QUESTION,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gateway.base_url, api_key="nope", max_retries=0).messages.count_tokens(
            model="tiny", messages=QUESTION)
