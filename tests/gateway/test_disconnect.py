"""A client that goes away must cancel the router call (so the engine aborts the request)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

STREAM_ROUTES = [("/v1/messages", "content_block_delta"), ("/v1/chat/completions", '"content":"w0 "'),
                 ("/v1/completions", '"text":"w0 "')]


def _body(path: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": "hang", "max_tokens": max_tokens, "stream": stream}
    if path == "/v1/completions":
        return {**body, "prompt": "Hello"}
    return {**body, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.mark.parametrize("path,first_token_marker", STREAM_ROUTES)
def test_closing_a_stream_cancels_the_router_call(gateway, path, first_token_marker):
    headers = {"x-api-key": gateway.paid_key}
    with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
        with client.stream("POST", path, json=_body(path, 50, True), headers=headers) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            # Keep the iterator referenced: a discarded httpx line iterator closes the connection by itself.
            lines = response.iter_lines()
            assert any(first_token_marker in line for line in lines)
            assert request_id not in _cancelled_ids(gateway)
    # Leaving the blocks closed the connection mid-stream.
    assert gateway.fake.wait_until(lambda: request_id in _cancelled_ids(gateway))


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_disconnect_before_a_whole_answer_cancels_the_router_call(gateway, path):
    max_tokens = 37 if path == "/v1/messages" else 38  # marks this test's request at the fake router
    num_before = _count(gateway.fake.requests, max_tokens)
    body = json.dumps(_body(path, max_tokens, False)).encode()
    host, port = gateway.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                     f"x-api-key: {gateway.paid_key}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        assert gateway.fake.wait_until(lambda: _count(gateway.fake.requests, max_tokens) > num_before)
    assert gateway.fake.wait_until(lambda: _count(gateway.fake.cancelled, max_tokens) > num_before)


def _cancelled_ids(gateway) -> set[str]:
    return {r.request_id for r in gateway.fake.cancelled}


def _count(requests, max_tokens: int) -> int:
    return sum(r.sampling.max_tokens == max_tokens for r in requests)
