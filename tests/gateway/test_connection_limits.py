"""Connection hygiene on the real uvicorn: slow clients are cut at the read deadlines, an idle kept-alive connection
is closed cleanly at the keep-alive (not cut at the header deadline), a key past its cap on open streams gets 429
and a gateway past its requests in flight 503, each in the dialect's shape with Retry-After."""

from __future__ import annotations

import contextlib
import http.client
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.waiting import wait_until

from .in_process_gateway import InProcessGateway

READ_TIMEOUT_S = 0.5
KEEP_ALIVE_S = 1.5  # longer than the read deadlines, as by default (20 s against 10 s)
MAX_STREAMS_PER_KEY = 2
MAX_IN_FLIGHT = 3
CUT_WITHIN_S = 5.0  # generous: the deadline is READ_TIMEOUT_S; only "never" must fail
PATHS = ("/v1/chat/completions", "/v1/messages")


@pytest.fixture(scope="module")
def strict_gateway(checkpoint_dir, tmp_path_factory):
    gw = InProcessGateway(checkpoint_dir, tmp_path_factory.mktemp("strict-gateway-keys"),
                          header_timeout_s=READ_TIMEOUT_S, body_timeout_s=READ_TIMEOUT_S, keep_alive_s=KEEP_ALIVE_S,
                          max_streams_per_key=MAX_STREAMS_PER_KEY, max_concurrent_requests=MAX_IN_FLIGHT).start()
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
