"""Connection hygiene in front of the app: read deadlines on each connection (slowloris), a limit on requests in
flight, and a per-key cap on open streams. Each refusal is the dialect's error, never a bare status."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Callable

import httptools
import orjson

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from flotilla.gateway.auth import Principal
from flotilla.gateway.dialects import dialect_for_path, error_body, error_response
from flotilla.gateway.errors import ErrorKind, GatewayError


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: httptools stops parsing and the protocol answers 431."""


def deadline_protocol(header_timeout_s: float, body_timeout_s: float, write_timeout_s: float, keep_alive_s: float,
                      max_header_bytes: int, send_buffer_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (its h11 one cost the gateway ~13% more CPU per streamed token, in the h11 send
    path) with what uvicorn lacks: a bound on the request line and headers (`max_header_bytes`, past it 431 in the
    path's dialect; httptools itself has none), and deadlines (its keep-alive timer stops at the first byte of a
    request, and a write to a client that stopped reading waits forever): the request line and headers within
    header_timeout_s of the connection opening (on a kept-alive connection: of the next request's first byte), the
    body within body_timeout_s after them, and a response whose writes are stalled (kernel and transport buffers
    full) for write_timeout_s; the kernel's part of those buffers is `send_buffer_bytes` (not autotuned up to
    megabytes, which a client that stops reading would pin). Past any deadline the connection is aborted; the app
    sees the client gone (a stream is cut: its generation is cancelled and its usage recorded as for any
    disconnect). An idle kept-alive connection is closed by uvicorn's keep-alive timer (`keep_alive_s`, the same
    value); the deadline armed after a response only backs it up."""

    class DeadlineProtocol(HttpToolsProtocol):
        _read_deadline: asyncio.TimerHandle | None = None
        _awaiting: str | None = None  # "headers", "body" or "idle" (between requests) while a deadline runs
        _write_deadline: asyncio.TimerHandle | None = None
        _header_bytes = 0  # of the request being parsed: its URL and header lines
        _headers_too_large = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            super().connection_made(transport)
            self._arm("headers", header_timeout_s)

        def data_received(self, data: bytes) -> None:
            if self._awaiting == "idle":  # the next request on a kept-alive connection begins
                self._arm("headers", header_timeout_s)
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value) + 4)  # ": " and CRLF
            super().on_header(name, value.rstrip(b" \t"))  # llhttp strips the leading whitespace only (RFC 9110: both)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm("body", body_timeout_s)  # on_message_complete disarms it (at once when there is no body)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            if self._awaiting == "body":
                self._disarm()

        def send_400_response(self, msg: str) -> None:  # uvicorn's answer to any parser error
            if not self._headers_too_large:
                super().send_400_response(msg)
                return
            try:
                path = httptools.parse_url(self.url).path.decode("ascii", "replace")
            except httptools.HttpParserInvalidURLError:  # cut off mid-URL: the dialect is a guess from its start
                path = self.url.decode("ascii", "replace").partition(" ")[0]
            err = GatewayError(ErrorKind.HEADERS_TOO_LARGE, f"the request line and headers are over the "
                               f"gateway's limit of {max_header_bytes} bytes", code="request_header_too_large")
            body = orjson.dumps(error_body(dialect_for_path(path), err))
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
                                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm("idle", keep_alive_s + header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._write_resumed()
            super().connection_lost(exc)

        def pause_writing(self) -> None:  # the transport's buffer is past its high-water mark
            super().pause_writing()
            if self._write_deadline is None:
                self._write_deadline = self.loop.call_later(write_timeout_s, self._abort)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._write_resumed()

        def _count_header_bytes(self, count: int) -> None:
            self._header_bytes += count
            if self._header_bytes > max_header_bytes:
                self._headers_too_large = True
                raise _HeadersTooLarge()

        def _write_resumed(self) -> None:
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _arm(self, awaiting: str, seconds: float) -> None:
            self._disarm()
            self._awaiting = awaiting
            self._read_deadline = self.loop.call_later(seconds, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
            self._read_deadline, self._awaiting = None, None

        def _read_timed_out(self) -> None:
            self._read_deadline, self._awaiting = None, None
            self._abort()

        def _abort(self) -> None:
            # abort, not close: close() would first wait to flush what a client that stopped reading never takes.
            self._write_deadline = None
            self.transport.abort()

    return DeadlineProtocol


class ConcurrencyLimit:
    """At most `limit` HTTP requests in the app at once; past it 503 with Retry-After in the path's dialect
    (uvicorn's own limit_concurrency answers a bare text 503, so it only caps connections)."""

    def __init__(self, app: ASGIApp, limit: int, retry_after_s: int):
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            err = GatewayError(ErrorKind.UNAVAILABLE, f"the gateway is at its limit of {self.limit} requests in "
                               "flight; retry later", code="too_many_requests_in_flight")
            await error_response(dialect_for_path(scope["path"]), err, self.retry_after_s)(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class StreamSlots:
    """Open streams per API key, in this gateway process: a key past its cap gets 429 with Retry-After."""

    def __init__(self, max_per_key: int, retry_after_s: int):
        self.max_per_key = max_per_key
        self.retry_after_s = retry_after_s
        self._open: Counter[str] = Counter()

    def open_streams(self, key_id: str) -> int:
        return self._open[key_id]

    def acquire(self, key_id: str) -> Callable[[], None]:
        """A slot for one stream, or GatewayError (429) when the key already holds its cap. Returns the slot's
        release, which may be called more than once (the stream's end and an error path may both call it)."""
        if self._open[key_id] >= self.max_per_key:
            raise GatewayError(ErrorKind.RATE_LIMITED, f"this API key already has {self.max_per_key} open streams, "
                               "the most one key may hold; retry when one ends", code="too_many_streams",
                               retry_after_s=self.retry_after_s)
        self._open[key_id] += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._open[key_id] -= 1
                if not self._open[key_id]:
                    del self._open[key_id]

        return release


STREAM_SLOT_SCOPE_KEY = "flotilla.stream_slot"


def hold_stream_slot(request: Request, principal: Principal) -> None:
    """Takes one of the caller's stream slots for the rest of the request: RequestContextMiddleware releases it
    once the response has ended, however it ends (so a resumable stream holds it while it generates)."""
    slots = request.app.state.gateway.stream_slots
    if slots is not None:
        request.scope[STREAM_SLOT_SCOPE_KEY] = slots.acquire(principal.key_id)


def release_stream_slot(scope: Scope) -> None:
    release = scope.pop(STREAM_SLOT_SCOPE_KEY, None)
    if release is not None:
        release()
