"""Hostile requests through the gateway process with its middlewares (resumable streams, idempotency keys) in
front of the app: they are answered with a dialect-shaped 4xx at once, having read no more than the body
limit, and the gateway serves on."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.fleet import MODEL

DEEP = b'{"model": "m", "max_tokens": 5, "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
MIB = 1024 * 1024


def _chunks(total: int, sent: list[int]):
    chunk = b"x" * MIB
    for _ in range(total // MIB):
        sent[0] += len(chunk)
        yield chunk


@pytest.mark.parametrize("headers", [{"x-flotilla-resumable": "true"}, {"idempotency-key": "k-upload"}, {}])
def test_oversized_unauthenticated_upload_is_refused_without_reading_it(fleet, headers):
    sent = [0]
    started = time.monotonic()
    response = httpx.post(f"{fleet.url}/v1/chat/completions", content=_chunks(64 * MIB, sent), timeout=30,
                          headers={"content-type": "application/json", **headers})
    assert response.status_code in (401, 413), response.text
    assert response.json()["error"]["type"] in ("invalid_request_error", "authentication_error")
    # Before the bounded read, the resumable path read all 64 MiB (quadratically, ~7 s) before answering 401.
    elapsed = time.monotonic() - started
    assert elapsed < 1.5, f"{elapsed:.2f} s, {sent[0] / MIB:.0f} MiB sent"


@pytest.mark.parametrize("headers", [{"x-flotilla-resumable": "true"}, {"idempotency-key": "k-deep"}, {}])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_deep_json_through_every_middleware_is_a_400(fleet, headers, path):
    response = httpx.post(f"{fleet.url}{path}", content=DEEP, timeout=30,
                          headers={**fleet.headers, "content-type": "application/json",
                                   **{k: v + path for k, v in headers.items()}})  # one idempotency key per route
    assert response.status_code == 400, response.text
    assert "not valid JSON" in response.text


def test_huge_last_event_id_is_not_a_500(fleet):
    response = httpx.get(f"{fleet.url}/v1/streams/abc", headers={**fleet.headers, "last-event-id": "abc." + "9" * 5000})
    assert response.status_code == 404


def test_the_gateway_still_serves(fleet):
    response = httpx.post(f"{fleet.url}/v1/completions", headers=fleet.headers, timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert response.status_code == 200
