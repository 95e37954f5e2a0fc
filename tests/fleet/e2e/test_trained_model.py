"""The real openai and anthropic SDKs against the fleet serving the trained default model (SmolLM2-135M-Instruct):
greedy answers to chat conversations, streamed and not, equal transformers' on the same checkpoint token for
token, with usage and finish reasons to match."""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import subprocess
import textwrap

import anthropic
import openai
import pytest

from flotilla.cli.up import usage_text
from flotilla.models.catalog import DEFAULT_MODEL

from tests.support.trained_model import MAX_TOKENS


async def _chat(oai: openai.AsyncOpenAI, messages: list[dict], stream: bool) -> tuple[str, str, int, int]:
    """-> (text, finish reason, prompt tokens, completion tokens)"""
    kwargs = dict(model=DEFAULT_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        r = await oai.chat.completions.create(**kwargs)
        choice, usage = r.choices[0], r.usage
        return choice.message.content, choice.finish_reason, usage.prompt_tokens, usage.completion_tokens
    text, finish, usage = "", None, None
    async for chunk in await oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage.prompt_tokens, usage.completion_tokens


async def _message(claude: anthropic.AsyncAnthropic, messages: list[dict], stream: bool) -> tuple[str, str, int, int]:
    system = [m["content"] for m in messages if m["role"] == "system"]
    kwargs = dict(model=DEFAULT_MODEL, max_tokens=MAX_TOKENS, messages=[m for m in messages if m["role"] != "system"],
                  extra_body={"temperature": 0}, **({"system": system[0]} if system else {}))
    if stream:
        async with claude.messages.stream(**kwargs) as events:
            text = "".join([delta async for delta in events.text_stream])
            final = await events.get_final_message()
    else:
        final = await claude.messages.create(**kwargs)
        text = "".join(block.text for block in final.content)
    reason = {"end_turn": "stop", "max_tokens": "length"}[final.stop_reason]
    usage = final.usage
    return text, reason, usage.input_tokens + (usage.cache_read_input_tokens or 0), usage.output_tokens


def test_both_sdks_answer_as_transformers_does(trained_fleet, trained_reference):
    conversations = trained_reference.conversations

    async def run_all():
        oai = openai.AsyncOpenAI(base_url=f"{trained_fleet.url}/v1", api_key=trained_fleet.api_key, max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=trained_fleet.url, api_key=trained_fleet.api_key, max_retries=0)
        async with oai, claude:
            return await asyncio.gather(*[_chat(oai, c, stream=i % 2 == 0) for i, c in enumerate(conversations)],
                                        *[_message(claude, c, stream=i % 2 == 1) for i, c in enumerate(conversations)])

    results = asyncio.run(run_all())
    expected = [
        (text, "stop" if ids[-1] in trained_reference.eos_token_ids else "length", len(prompt), len(ids))
        for text, ids, prompt in zip(trained_reference.texts, trained_reference.expected, trained_reference.prompts)
    ]
    assert results == expected + expected
    assert results[0][0] == "The capital of France is Paris."
    load = trained_fleet.worker_load()
    assert load.num_free_blocks == load.num_total_blocks


def test_the_examples_flotilla_up_prints_get_the_answer(trained_fleet):
    """`flotilla up`'s curl and SDK examples, run as printed: the keys file holds a Bearer/x-api-key key."""
    text = usage_text(trained_fleet.url, trained_fleet.model, trained_fleet.api_key)
    curl, openai_part, anthropic_part = text.split("\n\n")[1:4]
    for part in (openai_part, anthropic_part):
        code = textwrap.dedent(part.split(":\n", 1)[1])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code, {})
        assert printed.getvalue() == "The capital of France is Paris.\n"
    if shutil.which("curl"):
        answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, check=True).stdout
        assert '"text":"The capital of France is Paris."' in answer


def test_the_default_model_refuses_tools_and_counts_tokens_exactly(trained_fleet, trained_reference):
    """SmolLM2's ChatML template renders no tools: both dialects say so (400 naming tools) instead of answering
    as if the tools were not there. count_tokens equals transformers' prompt length for each conversation."""
    oai = openai.OpenAI(base_url=f"{trained_fleet.url}/v1", api_key=trained_fleet.api_key, max_retries=0)
    claude = anthropic.Anthropic(base_url=trained_fleet.url, api_key=trained_fleet.api_key, max_retries=0)
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with pytest.raises(openai.BadRequestError, match="tools is not supported by this model"):
        oai.chat.completions.create(model=trained_fleet.model, messages=question, max_tokens=8, tools=[
            {"type": "function", "function": {"name": tool["name"], "parameters": tool["input_schema"]}}])
    with pytest.raises(anthropic.BadRequestError, match="tools is not supported by this model"):
        claude.messages.create(model=trained_fleet.model, messages=question, max_tokens=8, tools=[tool])
    for conversation, prompt in zip(trained_reference.conversations, trained_reference.prompts):
        system = [m["content"] for m in conversation if m["role"] == "system"]
        messages = [m for m in conversation if m["role"] != "system"]
        kwargs = {"system": system[0]} if system else {}
        count = claude.messages.count_tokens(model=trained_fleet.model, messages=messages, **kwargs)
        assert count.input_tokens == len(prompt), conversation
