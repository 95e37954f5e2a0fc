"""The real openai and anthropic SDKs against the real fleet: 32 concurrent requests, streamed and not,
whose greedy text must equal the offline engine's output for the same prompt tokens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import anthropic
import openai
import pytest

from flotilla.engine.sampling_params import SamplingParams

NUM_REQUESTS = 32
TOPICS = ["ships", "harbours", "lighthouses", "tides", "knots", "sails", "anchors", "compasses"]


@dataclass
class Case:
    api: str  # "chat", "completions", "messages"
    stream: bool
    text: str
    max_tokens: int


def _cases() -> list[Case]:
    apis = ["chat", "completions", "messages"]
    return [
        Case(apis[i % 3], bool(i % 2), f"Tell me about {TOPICS[i % 8]} number {i}.", 6 + (i * 5) % 19)
        for i in range(NUM_REQUESTS)
    ]


def _expected(engine, case: Case) -> tuple[list[int], str, str, int]:
    tokenizer = engine.tokenizer
    if case.api == "completions":
        prompt = tokenizer.encode(case.text)
    else:
        prompt = tokenizer.encode_chat([{"role": "user", "content": case.text}])
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=case.max_tokens, temperature=0.0))
    return prompt, result.text, result.finish_reason.value, len(result.token_ids)


async def _run(case: Case, oai: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic, model: str):
    """-> (text, finish reason in OpenAI terms, prompt tokens, completion tokens)"""
    messages = [{"role": "user", "content": case.text}]
    if case.api == "chat":
        return await _chat(oai, model, messages, case)
    if case.api == "completions":
        return await _completion(oai, model, case)
    return await _message(claude, model, messages, case)


async def _chat(oai, model, messages, case):
    kwargs = dict(model=model, messages=messages, max_tokens=case.max_tokens, temperature=0)
    if not case.stream:
        r = await oai.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens
    text, finish, usage = "", None, None
    stream = await oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage.prompt_tokens, usage.completion_tokens


async def _completion(oai, model, case):
    kwargs = dict(model=model, prompt=case.text, max_tokens=case.max_tokens, temperature=0)
    if not case.stream:
        r = await oai.completions.create(**kwargs)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens
    text, finish, usage = "", None, None
    stream = await oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage.prompt_tokens, usage.completion_tokens


async def _message(claude, model, messages, case):
    kwargs = dict(model=model, messages=messages, max_tokens=case.max_tokens, extra_body={"temperature": 0})
    if not case.stream:
        r = await claude.messages.create(**kwargs)
        text = "".join(block.text for block in r.content)
        prompt_tokens = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
        return text, _openai_reason(r.stop_reason), prompt_tokens, r.usage.output_tokens
    async with claude.messages.stream(**kwargs) as stream:
        text = "".join([delta async for delta in stream.text_stream])
        final = await stream.get_final_message()
    prompt_tokens = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    return text, _openai_reason(final.stop_reason), prompt_tokens, final.usage.output_tokens


def _openai_reason(stop_reason: str) -> str:
    return {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}[stop_reason]


def test_sdks_match_offline_engine_under_concurrency(fleet, offline_engine):
    cases = _cases()
    expected = [_expected(offline_engine, case) for case in cases]

    async def run_all():
        oai = openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=fleet.url, api_key=fleet.api_key, max_retries=0)
        async with oai, claude:
            return await asyncio.gather(*[_run(case, oai, claude, fleet.model) for case in cases])

    results = asyncio.run(run_all())
    assert len({text for _, text, _, _ in expected}) > NUM_REQUESTS // 2  # outputs depend on the prompt
    for case, (prompt, text, finish, num_tokens), (got_text, got_finish, prompt_tokens, completion_tokens) in zip(
        cases, expected, results
    ):
        assert got_text == text, case
        assert got_finish == finish, case
        assert prompt_tokens == len(prompt), case
        assert completion_tokens == num_tokens, case
    load = fleet.worker_load()
    assert load.num_free_blocks == load.num_total_blocks


def test_usage_counts_generated_tokens(fleet, offline_engine):
    text = "Count my tokens, please."
    prompt = offline_engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    (result,) = offline_engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.api_key, max_retries=0)
    r = client.chat.completions.create(
        model=fleet.model, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0
    )
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(result.token_ids)
    assert r.usage.total_tokens == len(prompt) + len(result.token_ids)


def test_bad_key_is_refused_by_both_sdks(fleet):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="fl-wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=fleet.url, api_key="fl-wrong", max_retries=0).messages.create(
            model=fleet.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
