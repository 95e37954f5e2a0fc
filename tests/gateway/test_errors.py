"""The bad-input matrix over both dialects: status AND error body shape, all answered before the router
sees the request; router refusals mapped to statuses with Retry-After."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from .fake_router import MAX_MODEL_LEN
from .in_process_gateway import MAX_BODY_BYTES


@dataclass(frozen=True)
class Route:
    path: str
    dialect: str  # "anthropic" | "openai"

    def body(self, **overrides) -> dict:
        if self.path == "/v1/completions":
            base = {"model": "tiny", "prompt": "Hello", "max_tokens": 5}
        else:
            base = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5}
        base.update(overrides)
        return {k: v for k, v in base.items() if v is not DROP}


DROP = object()
MESSAGES = Route("/v1/messages", "anthropic")
CHAT = Route("/v1/chat/completions", "openai")
COMPLETIONS = Route("/v1/completions", "openai")
ROUTES = [MESSAGES, CHAT, COMPLETIONS]
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   413: "request_too_large", 503: "api_error", 529: "overloaded_error"}


def post(gateway, route: Route, body=None, content=None, key: str | None = "paid", headers=None) -> httpx.Response:
    headers = dict(headers or {})
    if key == "paid":
        headers["authorization" if route.dialect == "openai" else "x-api-key"] = (
            f"Bearer {gateway.paid_key}" if route.dialect == "openai" else gateway.paid_key)
    elif key is not None:
        headers["x-api-key"] = key
    return httpx.post(gateway.base_url + route.path, json=body, content=content, headers=headers, timeout=30)


def assert_error(response: httpx.Response, route: Route, status: int, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    if route.dialect == "anthropic":
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == ANTHROPIC_TYPES[status]
        error = body["error"]
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        error = body["error"]
    assert contains in error["message"], error["message"]
    return error


@pytest.fixture
def router_untouched(gateway):
    """Fails the test if the router saw a request: every rejection here happens before any engine work."""
    num_before = len(gateway.fake.requests)
    yield
    assert len(gateway.fake.requests) == num_before


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.path)
class TestRejectedBeforeRouter:
    def test_malformed_json(self, gateway, route, router_untouched):
        assert_error(post(gateway, route, content=b'{"model": "tiny", '), route, 400, "not valid JSON")

    def test_body_not_an_object(self, gateway, route, router_untouched):
        assert_error(post(gateway, route, body=[1, 2]), route, 400, "JSON object")

    def test_wrong_type(self, gateway, route, router_untouched):
        error = assert_error(post(gateway, route, body=route.body(max_tokens="5")), route, 400, "max_tokens")
        if route.dialect == "openai":
            assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"

    def test_wrong_nested_type(self, gateway, route, router_untouched):
        field = "prompt" if route is COMPLETIONS else "messages"
        bad = {"prompt": {"text": "x"}} if route is COMPLETIONS else {"messages": [{"role": "user", "content": 5}]}
        assert_error(post(gateway, route, body=route.body(**bad)), route, 400, field)

    def test_missing_max_tokens(self, gateway, route, router_untouched):
        error = assert_error(post(gateway, route, body=route.body(max_tokens=DROP)), route, 400, "max_tokens")
        if route.dialect == "openai":
            assert error["param"] == "max_tokens"

    def test_out_of_range_sampling(self, gateway, route, router_untouched):
        assert_error(post(gateway, route, body=route.body(temperature=5.0)), route, 400, "temperature")

    def test_unknown_model(self, gateway, route, router_untouched):
        error = assert_error(post(gateway, route, body=route.body(model="no-such-model")), route, 404, "no-such-model")
        if route.dialect == "openai":
            assert error["code"] == "model_not_found"

    @pytest.mark.parametrize("key", [None, "fl-not-a-key", "Bearer-ish"])
    def test_bad_or_missing_key(self, gateway, route, key, router_untouched):
        assert_error(post(gateway, route, body=route.body(), key=key), route, 401, "API key")

    def test_oversized_body_by_content_length(self, gateway, route, router_untouched):
        body = route.body(padding="x" * (MAX_BODY_BYTES + 10))
        assert_error(post(gateway, route, body=body), route, 413, str(MAX_BODY_BYTES))

    def test_oversized_chunked_body_is_counted(self, gateway, route, router_untouched):
        # No Content-Length: the gateway has to count what actually arrives.
        def chunks():
            yield b'{"padding": "'
            for _ in range(MAX_BODY_BYTES // 1024 + 2):
                yield b"x" * 1024
            yield b'"}'

        assert_error(post(gateway, route, content=chunks()), route, 413, "exceeds the limit")

    def test_prompt_beyond_context_window(self, gateway, route, router_untouched):
        long_text = "hello world " * MAX_MODEL_LEN
        body = (route.body(prompt=long_text) if route is COMPLETIONS
                else route.body(messages=[{"role": "user", "content": long_text}]))
        error = assert_error(post(gateway, route, body=body), route, 400, f"context window of {MAX_MODEL_LEN}")
        assert "max_tokens (5)" in error["message"]

    def test_max_tokens_beyond_context_window(self, gateway, route, router_untouched):
        error = assert_error(post(gateway, route, body=route.body(max_tokens=MAX_MODEL_LEN)), route, 400,
                             f"max_tokens ({MAX_MODEL_LEN})")
        assert "prompt (" in error["message"] and str(MAX_MODEL_LEN) in error["message"]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS], ids=lambda r: r.path)
def test_openai_policy_rejections(gateway, route, router_untouched):
    assert_error(post(gateway, route, body=route.body(n=2)), route, 400, "n=1")
    assert_error(post(gateway, route, body=route.body(stream="yes")), route, 400, "stream")
    assert_error(post(gateway, route, body=route.body(seed=-1)), route, 400, "seed")


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.path)
def test_unknown_fields_are_refused_naming_them(gateway, route, router_untouched):
    # Nothing is silently dropped: a field this server does not know is a 400 that names it.
    error = assert_error(post(gateway, route, body=route.body(some_future_field={"x": 1})), route, 400,
                         "some_future_field is not supported")
    if route.dialect == "openai":
        assert error["param"] == "some_future_field" and error["code"] == "unsupported_field"


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.path)
@pytest.mark.parametrize("model,status", [("busy", 529), ("gone", 503)])
def test_router_refusals_carry_retry_after(gateway, route, model, status):
    for stream in (False, True):
        response = post(gateway, route, body=route.body(model=model, stream=stream))
        assert_error(response, route, status)
        assert response.headers["retry-after"] == str(gateway.settings.retry_after_s)


def test_unknown_route_is_openai_404(gateway):
    response = httpx.get(gateway.base_url + "/v1/nope")
    error = assert_error(response, CHAT, 404, "/v1/nope")
    assert error["code"] == "unknown_url"


def test_wrong_method_is_405_in_the_path_dialect(gateway):
    response = httpx.get(gateway.base_url + "/v1/messages")
    assert response.status_code == 405 and response.json()["type"] == "error" and "POST" in response.headers["allow"]
    response = httpx.get(gateway.base_url + "/v1/chat/completions")
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
