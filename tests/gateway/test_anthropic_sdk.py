"""POST /v1/messages driven by the real `anthropic` SDK (and raw SSE for the exact event sequence)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from .fake_router import CACHED_TOKENS, NUM_NATURAL_TOKENS, canned_text

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def client(gateway):
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.paid_key, max_retries=0)


def test_create_message(gateway, client, tokenizer):
    response = client.messages.with_raw_response.create(
        model="tiny", max_tokens=20, system=[{"type": "text", "text": "Be brief."}],
        extra_body={"top_k": 5, "temperature": 0.5},  # this SDK version has no sampling arguments
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
        metadata={"user_id": "u-1"})
    message = response.parse()
    sent = gateway.fake.request_by_id(response.headers["request-id"])

    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "tiny"
    assert [(block.type, block.text) for block in message.content] == [("text", canned_text(NUM_NATURAL_TOKENS))]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    expected = tokenizer.encode_chat([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hello there"}])
    assert list(sent.prompt_token_ids) == expected
    assert sent.sampling.top_k == 5 and sent.sampling.temperature == 0.5
    # Anthropic reports cache reads apart from input_tokens.
    assert message.usage.input_tokens == len(expected) - CACHED_TOKENS
    assert message.usage.cache_read_input_tokens == CACHED_TOKENS
    assert message.usage.output_tokens == NUM_NATURAL_TOKENS


def test_stop_reasons(client):
    length = client.messages.create(model="tiny", max_tokens=2, messages=MESSAGES)
    assert length.stop_reason == "max_tokens" and length.content[0].text == canned_text(2)
    stopped = client.messages.create(model="tiny", max_tokens=20, messages=MESSAGES, stop_sequences=["END"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "END"


def test_assistant_prefill_continues_the_text(gateway, client, tokenizer):
    client.messages.create(model="tiny", max_tokens=5, messages=[*MESSAGES, {"role": "assistant", "content": "Sure,"}])
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert list(gateway.fake.requests[-1].prompt_token_ids) == tokenizer.encode(prefix + "Sure,",
                                                                                add_special_tokens=False)


def test_stream_with_sdk(client):
    with client.messages.stream(model="tiny", max_tokens=20, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == canned_text(NUM_NATURAL_TOKENS) == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == NUM_NATURAL_TOKENS
    assert final.usage.cache_read_input_tokens == CACHED_TOKENS


def test_stream_event_sequence(gateway):
    body = {"model": "tiny", "max_tokens": 3, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", gateway.base_url + "/v1/messages", json=body,
                      headers={"x-api-key": gateway.paid_key}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response.iter_lines())

    names = [name for name, _ in events]
    # Tokens that reach the gateway together leave in one delta: how many deltas depends on timing.
    collapsed = [name for i, name in enumerate(names) if name != "content_block_delta" or names[i - 1] != name]
    assert collapsed == ["message_start", "content_block_start", "ping", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas) and "".join(d["text"] for d in deltas) == canned_text(3)
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 3


def test_stream_error_event_mid_stream(gateway, client):
    with pytest.raises(anthropic.APIStatusError, match="workers failed this request"):
        with client.messages.stream(model="midfail", max_tokens=20, messages=MESSAGES) as stream:
            "".join(stream.text_stream)


def test_models_list(client):
    page = client.models.list()
    assert "tiny" in [m.id for m in page.data]
    assert page.first_id == page.data[0].id and page.has_more is False


def test_sdk_raises_typed_errors(gateway, client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=MESSAGES)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gateway.base_url, api_key="fl-wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=5, messages=MESSAGES)
    with pytest.raises(anthropic.InternalServerError) as overloaded:
        client.messages.create(model="busy", max_tokens=5, messages=MESSAGES)
    assert overloaded.value.status_code == 529 and overloaded.value.body["error"]["type"] == "overloaded_error"


def _sse_events(lines) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events
