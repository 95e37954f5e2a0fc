"""Bad input through the real fleet gets each dialect's error shape and status before any engine work;
a client that vanishes mid-stream has its request aborted and its KV blocks freed on the worker."""

from __future__ import annotations

import json

import httpx
import pytest

from flotilla.engine.sampling_params import SamplingParams

from tests.support.waiting import wait_until

ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


def _headers(fleet, dialect: str, key: str | None = None) -> dict[str, str]:
    key = key or fleet.api_key
    auth = {"x-api-key": key} if dialect == "anthropic" else {"authorization": f"Bearer {key}"}
    return {**auth, "content-type": "application/json"}


def _body(fleet, **overrides) -> dict:
    body = {"model": fleet.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not None}


def _error_type(dialect: str, response: httpx.Response) -> str:
    payload = response.json()
    if dialect == "anthropic":
        assert payload["type"] == "error" and isinstance(payload["error"]["message"], str)
        return payload["error"]["type"]
    assert isinstance(payload["error"]["message"], str)
    return payload["error"]["type"]


CASES = [
    # name, status, anthropic error type, openai error type
    ("malformed_json", 400, "invalid_request_error", "invalid_request_error"),
    ("missing_max_tokens", 400, "invalid_request_error", "invalid_request_error"),
    ("wrong_type", 400, "invalid_request_error", "invalid_request_error"),
    ("unknown_model", 404, "not_found_error", "invalid_request_error"),
    ("bad_key", 401, "authentication_error", "invalid_request_error"),
    ("oversized_body", 413, "request_too_large", "invalid_request_error"),
    ("prompt_too_long", 400, "invalid_request_error", "invalid_request_error"),
]


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
@pytest.mark.parametrize(("case", "status", "anthropic_type", "openai_type"), CASES)
def test_bad_input_gets_dialect_error(fleet, dialect, case, status, anthropic_type, openai_type):
    before = fleet.worker_load().num_prompt_tokens_total
    headers = _headers(fleet, dialect)
    content = json.dumps(_body(fleet)).encode()
    if case == "malformed_json":
        content = b'{"model": "x", "max_tokens": 8, "messages": ['
    elif case == "missing_max_tokens":
        content = json.dumps(_body(fleet, max_tokens=None)).encode()
    elif case == "wrong_type":
        content = json.dumps(_body(fleet, max_tokens="eight")).encode()
    elif case == "unknown_model":
        content = json.dumps(_body(fleet, model="no-such-model")).encode()
    elif case == "bad_key":
        headers = _headers(fleet, dialect, key="fl-not-a-key")
    elif case == "oversized_body":
        content = json.dumps(_body(fleet, messages=[{"role": "user", "content": "x" * (5 << 20)}])).encode()
    elif case == "prompt_too_long":
        content = json.dumps(_body(fleet, max_tokens=2000, messages=[{"role": "user", "content": "ship " * 400}])).encode()
    response = httpx.post(fleet.url + ROUTES[dialect], content=content, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    assert _error_type(dialect, response) == (anthropic_type if dialect == "anthropic" else openai_type)
    if case == "prompt_too_long":
        message = response.text
        assert "2000" in message and "2048" in message  # max_tokens and the context window are named
    assert fleet.worker_load().num_prompt_tokens_total == before  # the engine never saw it


def _long_running_prompt(offline_engine) -> str:
    """A prompt whose greedy continuation does not end early, so that a stream is surely cut mid-way."""
    for i in range(40):
        text = f"Write a very long story, part {i}."
        prompt = offline_engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        (result,) = offline_engine.generate([prompt], SamplingParams(max_tokens=300, temperature=0.0))
        if result.finish_reason.value == "length":
            return text
    pytest.fail("no prompt runs 300 tokens without eos")


@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
def test_client_disconnect_aborts_and_frees_blocks(fleet, offline_engine, dialect):
    text = _long_running_prompt(offline_engine)
    body = _body(fleet, max_tokens=1500, stream=True, messages=[{"role": "user", "content": text}])
    tokens_before = fleet.worker_load().num_output_tokens_total
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", fleet.url + ROUTES[dialect], json=body, headers=_headers(fleet, dialect)) as r:
            assert r.status_code == 200
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data:")
                if lines == 3:
                    assert fleet.worker_load().active_request_ids  # it is running now
                if lines >= 5:
                    break  # leaving the loop closes the connection mid-stream

    def aborted_and_freed():
        load = fleet.worker_load()
        return load if not load.active_request_ids and load.num_free_blocks == load.num_total_blocks else None

    load = wait_until(aborted_and_freed, 10, lambda: f"the request aborted and its blocks freed: {fleet.worker_load()}",
                      interval_s=0.02)
    # Aborted long before its 1500 tokens (a few steps on a quiet machine; generous for a loaded one).
    assert load.num_output_tokens_total - tokens_before < 400
