"""Bodies and headers an attacker sends: each is a 400 in the dialect's error shape, never a 500, and costs
the gateway no more than reading it."""

from __future__ import annotations

import httpx
import pytest

ROUTES = {"/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
          "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}}


def _post(gateway, path: str, content: bytes | None = None, json: dict | None = None, **headers: str):
    return httpx.post(gateway.base_url + path, content=content, json=json, timeout=10,
                      headers={"x-api-key": gateway.paid_key, "content-type": "application/json", **headers})


def _assert_dialect_400(response: httpx.Response, path: str) -> dict:
    assert response.status_code == 400, response.text
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("depth", [65, 1_100, 30_000])  # past our limit, past orjson's, past the stack
def test_deeply_nested_json(gateway, path, depth):
    body = b'{"model": "tiny", "max_tokens": 5, "messages": ' + b"[" * depth + b"]" * depth + b"}"
    error = _assert_dialect_400(_post(gateway, path, content=body), path)
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("value", ["9" * 5000, "١٢٣".encode(), "-5", "0", "1e3", "12 34", b"\xa0600", b"600\x85"])
def test_deadline_header_is_parsed_strictly(gateway, path, value):
    # Bytes go on the wire as they are: Arabic-Indic digits in UTF-8, which str.isdigit() would accept.
    error = _assert_dialect_400(_post(gateway, path, json=ROUTES[path], **{"x-flotilla-deadline-ms": value}), path)
    assert "x-flotilla-deadline-ms" in error["message"]


@pytest.mark.parametrize("stop", [["x" * 20_000] * 2, ["x" * 513], ["a"] * 17])
def test_stop_strings_are_bounded(gateway, stop):
    body = {**ROUTES["/v1/chat/completions"], "stop": stop}
    error = _assert_dialect_400(_post(gateway, "/v1/chat/completions", json=body), "/v1/chat/completions")
    assert error["param"] == "stop"


def test_nan_is_not_json(gateway):
    body = b'{"model": "tiny", "max_tokens": 5, "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}'
    _assert_dialect_400(_post(gateway, "/v1/chat/completions", content=body), "/v1/chat/completions")


async def test_the_in_process_idempotency_store_forgets_its_oldest_entries_past_its_bound():
    from flotilla.gateway.idempotency import Entry, MemoryIdempotencyStore

    store = MemoryIdempotencyStore(max_entries=3)
    for i in range(5):
        assert await store.claim(f"k{i}", "f", "owner", lease_s=60) is None
        await store.complete(f"k{i}", "owner", Entry("done", "f", "owner", 200), ttl_s=60)
    assert len(store) == 3
    assert await store.claim("k0", "f", "other", lease_s=60) is None  # forgotten: claimable again
    assert (await store.claim("k4", "f", "other", lease_s=60)).state == "done"


@pytest.mark.parametrize("path", ROUTES)
def test_the_priority_header_only_lowers_a_keys_class(gateway, path):
    def post(key: str, priority: str) -> httpx.Response:
        return httpx.post(gateway.base_url + path, json=ROUTES[path], timeout=10,
                          headers={"x-api-key": key, "x-flotilla-priority": priority})

    raised = post(gateway.batch_key, "interactive")
    assert raised.status_code == 403
    body = raised.json()
    error = body["error"]
    assert error["type"] == ("permission_error" if path == "/v1/messages" else "invalid_request_error")
    assert "may only lower it" in error["message"]
    assert post(gateway.batch_key, "batch").status_code == 200
    assert post(gateway.paid_key, "batch").status_code == 200


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("value", [b"\xa0batch", b"batch\x85", b"", b"batch,interactive"])
def test_a_priority_header_that_is_not_a_class_is_refused(gateway, path, value):
    """HTTP strips only spaces and tabs around a value (RFC 9110's OWS): a no-break space (0xA0 in latin-1) or a
    NEL (0x85), which str.strip() would also remove, leaves a value that is not a class (the fuzzer found this)."""
    error = _assert_dialect_400(_post(gateway, path, json=ROUTES[path], **{"x-flotilla-priority": value}), path)
    assert "x-flotilla-priority" in error["message"]


@pytest.mark.parametrize("path", ROUTES)
def test_top_logprobs_past_its_bound(gateway, path):
    if path == "/v1/messages":
        body = {**ROUTES[path], "top_logprobs": 2}  # not an Anthropic field: refused, never ignored
    else:
        body = {**ROUTES[path], "logprobs": True, "top_logprobs": 21}
    error = _assert_dialect_400(_post(gateway, path, json=body), path)
    assert "top_logprobs" in error["message"]


@pytest.mark.parametrize("logprobs", [6, -1])
def test_completion_logprobs_past_its_bounds(gateway, logprobs):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 5, "logprobs": logprobs}
    error = _assert_dialect_400(_post(gateway, "/v1/completions", json=body), "/v1/completions")
    assert error["param"] == "logprobs"


# Counts past the bounds take bodies past the test gateway's 64 KiB, so these go through the same parse_body the
# handlers call, with the same schemas.
def _many(count: int, item) -> list:
    return [item] * count


@pytest.mark.unit
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("what", ["messages", "content_blocks", "tools"])
def test_counts_past_their_bounds_are_400_naming_the_field(dialect, what):
    from flotilla.gateway.anthropic_schema import MessagesRequest
    from flotilla.gateway.body import parse_body
    from flotilla.gateway.errors import GatewayError
    from flotilla.gateway.openai_schema import ChatCompletionRequest
    from flotilla.gateway.schema_base import MAX_CONTENT_BLOCKS, MAX_MESSAGES, MAX_TOOLS
    import orjson

    block = {"type": "text", "text": "x"}
    message = {"role": "user", "content": "x"}
    body = {"model": "tiny", "max_tokens": 5, "messages": [message]}
    if what == "messages":
        body["messages"] = _many(MAX_MESSAGES + 1, message)
    elif what == "content_blocks":
        body["messages"] = [{"role": "user", "content": _many(MAX_CONTENT_BLOCKS + 1, block)}]
    elif dialect == "openai":
        body["tools"] = _many(MAX_TOOLS + 1, {"type": "function", "function": {"name": "f"}})
    else:
        body["tools"] = _many(MAX_TOOLS + 1, {"name": "f", "input_schema": {"type": "object"}})
    schema = ChatCompletionRequest if dialect == "openai" else MessagesRequest
    with pytest.raises(GatewayError) as raised:
        parse_body(schema, orjson.dumps(body))
    assert raised.value.kind.status == 400
    assert "at most" in raised.value.message and raised.value.param.split(".")[0] in ("messages", "tools")


@pytest.mark.unit
def test_a_bodys_total_text_is_bounded_before_any_tokenizing():
    from flotilla.gateway.body import MAX_TEXT_CHARS, parse_body
    from flotilla.gateway.errors import GatewayError
    from flotilla.gateway.openai_schema import ChatCompletionRequest
    import orjson

    half = "x" * (MAX_TEXT_CHARS // 2)
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": half},
                                                           {"role": "user", "content": half + "y"}]}
    with pytest.raises(GatewayError) as raised:
        parse_body(ChatCompletionRequest, orjson.dumps(body))
    assert raised.value.code == "text_too_long" and raised.value.kind.status == 400
