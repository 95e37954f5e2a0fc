"""Clients that attack the gateway process's connections (the real fleet, middlewares included): one that never
reads its stream, one that dribbles its headers, and unauthenticated oversized uploads on the middlewares' paths.
Each is cut or refused within its deadline, holds no more than the limits, and what was generated is billed."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from flotilla.usage.record import STATUS_OPEN
from flotilla.usage.sinks import read_file

from tests.support.waiting import wait_until

from .conftest import HEADER_TIMEOUT_S, MAX_BODY_BYTES, WRITE_TIMEOUT_S

MIB = 1024 * 1024
MAX_TOKENS = 1800  # with 20 logprobs a token's event is ~1.5 KB: ~2.7 MB, far more than the buffers (--send-buffer-bytes)


def _connect(fleet, receive_buffer: int | None = None) -> socket.socket:
    host, port = fleet.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:  # before connect: the window the server sees stays this small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    return sock


def _request(fleet, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {fleet.api_key}\r\ncontent-length: {len(payload)}\r\n\r\n").encode() + payload


def _records_since(fleet, since: float) -> list:
    """Final usage records (not the open checkpoints a running request leaves) of requests started since."""
    return [r for r in read_file(Path(fleet.state_dir) / "usage.jsonl") if r.started_at >= since
            and r.status != STATUS_OPEN]


def test_a_client_that_never_reads_its_stream_is_cut_and_billed(adversarial_fleet):
    fleet = adversarial_fleet
    body = {"model": fleet.model, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 20, "messages": [{"role": "user", "content": "hi"}]}
    started = time.time()
    with _connect(fleet, receive_buffer=4096) as sock:
        sock.sendall(_request(fleet, "/v1/chat/completions", body))
        # Never read: the gateway's writes stall, and WRITE_TIMEOUT_S later it aborts the connection.
        wait_until(lambda: _records_since(fleet, started), 30, "the cut stream's usage record", interval_s=0.1)
        [record] = _records_since(fleet, started)
        assert record.key_id == "k-attacker" and record.status == "cancelled"
        assert 0 < record.output_tokens < MAX_TOKENS  # billed for what it was sent; the rest never generated
        sock.settimeout(10)  # aborted: reading now finds the end (or the reset), not tokens forever
        tail = b""
        try:
            while data := sock.recv(1 << 20):
                tail = data
        except ConnectionResetError:
            pass
        assert b"[DONE]" not in tail
    assert time.time() - started < 30


def test_slowloris_headers_are_cut_at_the_header_deadline(adversarial_fleet):
    with _connect(adversarial_fleet) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: gateway\r\n")
        sock.settimeout(0.1)
        started = time.monotonic()
        closed = False
        while not closed and time.monotonic() - started < 10 * HEADER_TIMEOUT_S:
            try:
                sock.sendall(b"x")  # one byte of a header every 100 ms: each would restart an idle timer
                closed = sock.recv(1024) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed, "the dribbling connection was never closed"
        assert time.monotonic() - started < 5 * HEADER_TIMEOUT_S


def _vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _chunks(total: int):
    chunk = b"x" * MIB
    for _ in range(total // MIB):
        yield chunk


@pytest.mark.parametrize("headers", [{"x-flotilla-resumable": "true"}, {"idempotency-key": "k-upload"}])
def test_unauthenticated_oversized_uploads_are_refused_at_once_holding_under_twice_the_limit(adversarial_fleet,
                                                                                              headers):
    pid = adversarial_fleet.fleet.gateway.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets the peak resident size (VmHWM) to the current one
    baseline_kib = _vm_kib(pid, "VmHWM")
    started = time.monotonic()
    response = httpx.post(f"{adversarial_fleet.url}/v1/chat/completions", content=_chunks(64 * MIB), timeout=30,
                          headers={"content-type": "application/json", **headers})
    elapsed = time.monotonic() - started
    assert response.status_code in (401, 413), response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert elapsed < 1.0
    extra = (_vm_kib(pid, "VmHWM") - baseline_kib) * 1024
    assert extra < 2 * MAX_BODY_BYTES, f"peak extra memory {extra / MIB:.1f} MiB"


def test_the_gateway_still_serves(adversarial_fleet):
    response = httpx.post(f"{adversarial_fleet.url}/v1/completions", headers=adversarial_fleet.headers, timeout=30,
                          json={"model": adversarial_fleet.model, "prompt": "hi", "max_tokens": 3})
    assert response.status_code == 200
