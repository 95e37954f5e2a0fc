"""Connection hygiene on the real uvicorn: slow clients are cut at the read deadlines, an idle kept-alive connection
is closed cleanly at the keep-alive (not cut at the header deadline), headers past the limit get 431, a key past
its cap on open streams gets 429 and a gateway past its requests in flight 503, each in the dialect's shape (with
Retry-After where retrying helps)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from flotilla.gateway.connection_limits import deadline_protocol

from tests.support.waiting import wait_until

from .in_process_gateway import InProcessGateway

READ_TIMEOUT_S = 0.5
KEEP_ALIVE_S = 1.5  # longer than the read deadlines, as by default (20 s against 10 s)
MAX_STREAMS_PER_KEY = 2
MAX_IN_FLIGHT = 3
MAX_HEADER_BYTES = 4096
CUT_WITHIN_S = 5.0  # generous: the deadline is READ_TIMEOUT_S; only "never" must fail
PATHS = ("/v1/chat/completions", "/v1/messages")


@pytest.fixture(scope="module")
def strict_gateway(checkpoint_dir, tmp_path_factory):
    gw = InProcessGateway(checkpoint_dir, tmp_path_factory.mktemp("strict-gateway-keys"),
                          header_timeout_s=READ_TIMEOUT_S, body_timeout_s=READ_TIMEOUT_S, keep_alive_s=KEEP_ALIVE_S,
                          max_streams_per_key=MAX_STREAMS_PER_KEY, max_concurrent_requests=MAX_IN_FLIGHT,
                          max_header_bytes=MAX_HEADER_BYTES).start()
    yield gw
    gw.stop()


def _connect(gateway) -> socket.socket:
    host, port = gateway.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=CUT_WITHIN_S)


def _closed_within(sock: socket.socket, dribble: bytes) -> float:
    """Sends `dribble` a byte every 50 ms (each byte restarts no timer); seconds until the server closed."""
    start = time.monotonic()
    sock.settimeout(0.05)
    for byte in dribble * 1000:
        if time.monotonic() - start > CUT_WITHIN_S:
            break
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
    raise AssertionError(f"the connection was still open after {CUT_WITHIN_S} s")


def test_slowloris_headers_are_cut_at_the_header_deadline(strict_gateway):
    with _connect(strict_gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        assert _closed_within(sock, b"x-padding: aaaa\r\n") < CUT_WITHIN_S


def test_a_body_sent_too_slowly_is_cut_at_the_body_deadline(strict_gateway):
    with _connect(strict_gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"x-api-key: " + strict_gateway.paid_key.encode() + b"\r\ncontent-length: 100000\r\n\r\n")
        assert _closed_within(sock, b" ") < CUT_WITHIN_S


def test_kept_alive_connections_still_serve_request_after_request(strict_gateway):
    with httpx.Client(base_url=strict_gateway.base_url, headers={"x-api-key": strict_gateway.paid_key}) as client:
        for _ in range(3):
            assert client.get("/v1/models").status_code == 200
            time.sleep(READ_TIMEOUT_S / 5)


def test_an_idle_kept_alive_connection_outlasts_the_header_deadline_and_is_closed_cleanly_at_the_keep_alive(
        strict_gateway):
    host, port = strict_gateway.base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=CUT_WITHIN_S)
    headers = {"x-api-key": strict_gateway.paid_key}
    try:
        connection.request("GET", "/v1/models", headers=headers)
        assert connection.getresponse().read() and connection.sock is not None
        kept = connection.sock
        time.sleep(READ_TIMEOUT_S * 2)  # idle past the header deadline, within the keep-alive
        connection.request("GET", "/v1/models", headers=headers)
        answer = connection.getresponse()
        assert answer.status == 200 and answer.read() and connection.sock is kept  # the same connection
        answered = time.monotonic()
        assert kept.recv(1) == b""  # a clean close (FIN), not an abort (ConnectionResetError)
        assert KEEP_ALIVE_S * 0.8 < time.monotonic() - answered < CUT_WITHIN_S
    finally:
        connection.close()


def test_the_next_request_on_a_kept_alive_connection_has_the_header_deadline_from_its_first_byte(strict_gateway):
    with _connect(strict_gateway) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-api-key: " + strict_gateway.paid_key.encode()
                     + b"\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")  # then headers a byte every 50 ms
        assert _closed_within(sock, b"x-padding: aaaa\r\n") < KEEP_ALIVE_S  # at 0.5 s, not the idle backstop


def _raw_exchange(gateway, request: bytes) -> tuple[bytes, bytes]:
    """Sends `request` on a fresh connection; (head, body) of the answer, read until the server closes."""
    with _connect(gateway) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize("path", PATHS)
def test_headers_past_the_limit_get_431_in_the_dialect_and_the_connection_closes(strict_gateway, path):
    padding = b"x-padding: " + b"a" * MAX_HEADER_BYTES + b"\r\n"
    head, body = _raw_exchange(strict_gateway, b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n" + padding
                               + b"content-length: 2\r\n\r\n{}")
    assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head
    error = json.loads(body)
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert error["error"]["code"] == "request_header_too_large"


def test_a_url_past_the_header_limit_gets_431(strict_gateway):
    long_url = b"/v1/models?q=" + b"a" * MAX_HEADER_BYTES
    head, _ = _raw_exchange(strict_gateway, b"GET " + long_url + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")


def test_headers_within_the_limit_are_served(strict_gateway):
    padding = b"x-padding: " + b"a" * (MAX_HEADER_BYTES // 2) + b"\r\n"
    head, body = _raw_exchange(strict_gateway, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                               + padding + b"x-api-key: " + strict_gateway.paid_key.encode() + b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head + body


async def test_the_protocol_strips_the_whitespace_around_header_values():
    """RFC 9110: the whitespace around a field value is not part of it (llhttp strips only the leading)."""
    seen: list[tuple[bytes, bytes]] = []

    async def record_headers(scope, receive, send):
        seen.extend(scope["headers"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(record_headers, lifespan="off")
    config.load()
    protocol = deadline_protocol(5, 5, 5, 5, MAX_HEADER_BYTES, 65536)
    server = await asyncio.get_running_loop().create_server(
        lambda: protocol(config=config, server_state=ServerState(), app_state={}), "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-key: \t value with  inner spaces \t \r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 204 ")
        writer.close()
    finally:
        server.close()
    assert (b"x-key", b"value with  inner spaces") in seen


@contextlib.contextmanager
def _open_streams(gateway, key: str, path: str, count: int) -> Iterator[list[httpx.Response]]:
    """`count` streams of the "hang" model (one chunk, then nothing until cancelled), held open."""
    body = {"model": "hang", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=gateway.base_url, timeout=10))
        responses = [stack.enter_context(client.stream("POST", path, json=body, headers={"x-api-key": key}))
                     for _ in range(count)]
        assert [r.status_code for r in responses] == [200] * count
        yield responses


def _post(gateway, path: str, key: str, stream: bool) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 2, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(gateway.base_url + path, json=body, headers={"x-api-key": key}, timeout=10)


def _error(response: httpx.Response, path: str) -> dict:
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _slots_free(gateway) -> bool:
    return not gateway.app_state().stream_slots.open_streams("k-paid")


@pytest.mark.parametrize("path", PATHS)
def test_a_key_past_its_open_streams_gets_429_in_its_dialect(strict_gateway, path):
    with _open_streams(strict_gateway, strict_gateway.paid_key, path, MAX_STREAMS_PER_KEY):
        refused = _post(strict_gateway, path, strict_gateway.paid_key, stream=True)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "7"
        error = _error(refused, path)
        assert error["type"] == "rate_limit_error" and "open streams" in error["message"]
        assert _post(strict_gateway, path, strict_gateway.paid_key, stream=False).status_code == 200  # not a stream
        assert _post(strict_gateway, path, strict_gateway.free_key, stream=True).status_code == 200  # another key
    wait_until(lambda: _slots_free(strict_gateway), 10, "the closed streams' slots to be released")
    assert _post(strict_gateway, path, strict_gateway.paid_key, stream=True).status_code == 200


@pytest.mark.parametrize("path", PATHS)
def test_past_its_requests_in_flight_the_gateway_answers_503_in_the_dialect(strict_gateway, path):
    with (_open_streams(strict_gateway, strict_gateway.paid_key, path, MAX_STREAMS_PER_KEY),
          _open_streams(strict_gateway, strict_gateway.free_key, path, MAX_IN_FLIGHT - MAX_STREAMS_PER_KEY)):
        refused = _post(strict_gateway, path, strict_gateway.batch_key, stream=False)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "7"
        assert "requests in flight" in _error(refused, path)["message"]
    wait_until(lambda: _post(strict_gateway, path, strict_gateway.batch_key, False).status_code == 200, 10,
               "requests in flight to drain")
