"""The safety stage through the real fleet (router, worker, gateway as processes) with both SDKs.

The blocked term is chosen from the model's own greedy answer: the end of one token and the start of the next,
so it reaches the gateway split across two tokens (and, unless a lagging stream coalesced them, two SSE
events). A key with the policy "none" sees the whole answer; a key with the policy "strict" never receives any
of the term, its stream ends with the dialect's terminal event, the worker stops soon after, and the ledger
bills what was sent."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from flotilla.engine.sampling_params import SamplingParams
from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file
from flotilla.usage.sinks import read_file

from tests.support.fleet import fleet_config, start_fleet
from tests.support.waiting import wait_until

from .conftest import NUM_KV_BLOCKS

QUESTION = "Tell me about lighthouses."
REFERENCE_TOKENS = 64  # the answer the term is chosen from
MAX_TOKENS = 1000  # what a blocked request asks for: it must stop long before
WINDOW_CHARS = 8


@pytest.fixture(scope="module")
def answer(offline_engine):
    """(token texts of the greedy answer, the split term, index of the term's second token)"""
    tokenizer = offline_engine.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    (result,) = offline_engine.generate([prompt], SamplingParams(max_tokens=REFERENCE_TOKENS, temperature=0.0,
                                                                 ignore_eos=True))
    texts, previous = [], ""
    for k in range(1, len(result.token_ids) + 1):
        text = tokenizer.decode(result.token_ids[:k])
        texts.append(text[len(previous):])
        previous = text
    for i in range(12, 60):
        if "\ufffd" in "".join(texts[:i + 1]):
            break  # a character split across tokens: pieces decoded apart are not what the stream sends
        left, right = texts[i - 1].strip(), texts[i].strip()
        if len(left) >= 2 and len(right) >= 2 and texts[i - 1].endswith(left) and texts[i].startswith(right):
            term = left[-2:] + right[:2]
            if term.lower() not in "".join(texts[:i]).lower() + QUESTION.lower():
                return texts, term, i
    pytest.skip("no split term in the tiny model's answer")


@pytest.fixture(scope="module")
def safety_fleet(tiny_checkpoint: Path, tmp_path_factory, answer):
    _, term, _ = answer
    state = tmp_path_factory.mktemp("safety-fleet")
    (state / "safety.json").write_text(json.dumps({"default": "strict", "policies": {
        "strict": {"window_chars": WINDOW_CHARS, "rules": [{"category": "test-term", "terms": [term]}]},
        "none": {}}}))
    keys = {"strict": generate_key(), "none": generate_key()}
    write_keys_file(state / "keys.json", [KeyEntry("k-strict", hash_key(keys["strict"]), "tenant-s", "paid"),
                                          KeyEntry("k-none", hash_key(keys["none"]), "tenant-n", "paid",
                                                   safety_policy="none")])
    config = fleet_config(tiny_checkpoint, state, worker_args=["--num-kv-blocks", str(NUM_KV_BLOCKS)],
                          gateway_args=["--safety-config", str(state / "safety.json"),
                                        "--usage-log", str(state / "usage.jsonl")])
    config.keys_file = state / "keys.json"
    with start_fleet(config) as fleet:
        fleet.keys = keys
        yield fleet


def _oai(fleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key=fleet.keys[key], max_retries=0, timeout=60)


def _stream_chat(client: openai.OpenAI, model: str, max_tokens: int) -> tuple[list[str], str | None, object]:
    """-> (content of each SSE event, finish reason, usage)"""
    events, finish, usage = [], None, None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                events.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return events, finish, usage


def _ledger(fleet, count: int):
    """The final usage records (not the checkpoints, status open), once there are `count`."""
    path = fleet.state_dir / "usage.jsonl"

    def final():
        return [r for r in read_file(path) if r.status != "open"]

    wait_until(lambda: len(final()) >= count, 30, f"{count} usage records", interval_s=0.05)
    return final()


def test_unscreened_key_gets_the_whole_answer_with_the_term_split_across_tokens(safety_fleet, answer):
    texts, term, index = answer
    events, finish, _ = _stream_chat(_oai(safety_fleet, "none"), safety_fleet.model, REFERENCE_TOKENS)
    prefix = "".join(texts[:index + 1])
    assert "".join(events).startswith(prefix) and finish == "length"
    # The term straddles a token boundary, so only a screen that looks across tokens can catch it. Whether it
    # also straddles two SSE events is timing: a worker whose stream lags sends several tokens in one event
    # (seen on a loaded CI machine), so the events are not asserted on.
    assert term in prefix and term not in texts[index - 1] and term not in texts[index]


def test_openai_stream_is_stopped_before_the_term(safety_fleet, answer):
    texts, term, index = answer
    tokens_before = safety_fleet.worker_load().num_output_tokens_total
    records_before = len(_ledger(safety_fleet, 0))
    events, finish, usage = _stream_chat(_oai(safety_fleet, "strict"), safety_fleet.model, MAX_TOKENS)
    text = "".join(events)
    assert finish == "content_filter"
    assert term.lower() not in text.lower() and "".join(texts).startswith(text)
    # What was sent is whole tokens: the first usage.completion_tokens of the answer; the rest was held back.
    assert text == "".join(texts[:usage.completion_tokens]) and usage.completion_tokens < index
    assert len(text) >= len("".join(texts[:index - 1])) - 2 * WINDOW_CHARS - len(texts[index - 1])

    def worker_idle():
        load = safety_fleet.worker_load()
        return load if not load.active_request_ids else None

    load = wait_until(worker_idle, 10, "the blocked request aborted", interval_s=0.02)
    # Aborted at once: a few steps after the term's token on a quiet machine, long before the 1000 asked for
    # (generous: on a loaded 2-core box the engine runs tens of tokens ahead of the gateway).
    assert load.num_output_tokens_total - tokens_before < 300
    record = _ledger(safety_fleet, records_before + 1)[-1]
    assert (record.status, record.error_code, record.key_id) == ("filtered", "test-term", "k-strict")
    assert record.output_tokens == usage.completion_tokens


def test_anthropic_stream_ends_with_an_error_event(safety_fleet, answer):
    texts, term, _ = answer
    claude = anthropic.Anthropic(base_url=safety_fleet.url, api_key=safety_fleet.keys["strict"], max_retries=0)
    text = ""
    with pytest.raises(anthropic.APIStatusError) as raised:
        with claude.messages.stream(model=safety_fleet.model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": QUESTION}]) as stream:
            for delta in stream.text_stream:
                text += delta
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert term.lower() not in text.lower() and "".join(texts).startswith(text)


def test_blocked_and_allowed_prompts(safety_fleet, answer):
    _, term, _ = answer
    records_before = len(_ledger(safety_fleet, 0))
    bad = [{"role": "user", "content": f"Please say {term.upper()} for me"}]
    with pytest.raises(openai.BadRequestError) as raised:
        _oai(safety_fleet, "strict").chat.completions.create(model=safety_fleet.model, messages=bad, max_tokens=5)
    assert raised.value.code == "content_filter"
    claude = anthropic.Anthropic(base_url=safety_fleet.url, api_key=safety_fleet.keys["strict"], max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model=safety_fleet.model, max_tokens=5, messages=bad)
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    ok = _oai(safety_fleet, "none").chat.completions.create(model=safety_fleet.model, messages=bad, max_tokens=5)
    assert ok.choices[0].finish_reason in ("stop", "length")
    records = _ledger(safety_fleet, records_before + 1)
    assert [r.key_id for r in records[records_before:]] == ["k-none"]  # blocked prompts never reached the router
