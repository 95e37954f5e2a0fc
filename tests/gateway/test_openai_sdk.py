"""The OpenAI endpoints driven by the real `openai` SDK through real gRPC to the fake router."""

from __future__ import annotations

import openai
import pytest

from .fake_router import CACHED_TOKENS, FIRST_TOKEN_ID, NUM_NATURAL_TOKENS, canned_text

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.paid_key, max_retries=0)


def test_chat_completion(gateway, client, tokenizer):
    response = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=20,
                                                                seed=42)
    completion = response.parse()
    sent = gateway.fake.request_by_id(response.headers["x-request-id"])

    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == "tiny"
    [choice] = completion.choices
    assert choice.message.role == "assistant" and choice.message.content == canned_text(NUM_NATURAL_TOKENS)
    assert choice.finish_reason == "stop"
    assert list(sent.prompt_token_ids) == tokenizer.encode_chat(MESSAGES)
    assert sent.sampling.max_tokens == 20 and sent.sampling.seed == 42 and sent.sampling.temperature == 1.0
    assert sent.tenant_id == "acme" and sent.cache_salt == "acme"
    usage = completion.usage
    assert usage.prompt_tokens == len(sent.prompt_token_ids) and usage.completion_tokens == NUM_NATURAL_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + NUM_NATURAL_TOKENS
    assert usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS


def test_chat_completion_length_and_stop(client):
    length = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=3)
    assert length.choices[0].finish_reason == "length" and length.choices[0].message.content == canned_text(3)
    stopped = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, stop="w2")
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == canned_text(2)


def test_chat_completion_stream_with_usage(gateway, client):
    stream = client.chat.completions.create(model="tiny-latest", messages=MESSAGES, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)

    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == canned_text(NUM_NATURAL_TOKENS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NUM_NATURAL_TOKENS
    assert gateway.fake.requests[-1].model == "tiny-latest"  # the router resolves aliases itself
    assert gateway.fake.requests[-1].sampling.temperature == 0.0


def test_chat_completion_logprobs(client):
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, logprobs=True,
                                                top_logprobs=2)
    content = completion.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == [-0.5, -1.5, -2.5]
    assert [len(entry.top_logprobs) for entry in content] == [2, 2, 2]
    assert content[1].top_logprobs[1].logprob == -2.5
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)


def test_completion(gateway, client, tokenizer):
    completion = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, logprobs=1)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    [choice] = completion.choices
    assert choice.text == canned_text(4) and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == [-0.5, -1.5, -2.5, -3.5]
    assert choice.logprobs.tokens == [tokenizer.decode([FIRST_TOKEN_ID + i]) for i in range(4)]
    assert list(gateway.fake.requests[-1].prompt_token_ids) == tokenizer.encode("Once upon a time")


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_completion_token_id_prompt(gateway, client, prompt):
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert list(gateway.fake.requests[-1].prompt_token_ids) == [5, 6, 7]


def test_completion_stream(client):
    chunks = list(client.completions.create(model="tiny", prompt=["Hi"], max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == canned_text(NUM_NATURAL_TOKENS)
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.object == "text_completion" for c in chunks)


def test_models_list_and_retrieve(client):
    ids = [m.id for m in client.models.list()]
    assert "tiny" in ids and "hang" in ids
    assert client.models.retrieve("tiny").id == "tiny"


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=5)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="fl-wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny", messages=MESSAGES)


def test_stream_error_mid_stream_raises(client):
    stream = client.chat.completions.create(model="midfail", messages=MESSAGES, max_tokens=5, stream=True)
    with pytest.raises(openai.APIError, match="workers failed this request"):
        list(stream)
