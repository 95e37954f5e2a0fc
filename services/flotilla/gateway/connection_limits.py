"""Connection hygiene in front of the app: read deadlines on each connection (slowloris), a limit on requests in
flight, and a per-key cap on open streams. Each refusal is the dialect's error, never a bare status."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from flotilla.gateway.auth import Principal
from flotilla.gateway.dialects import dialect_for_path, error_response
from flotilla.gateway.errors import ErrorKind, GatewayError


def deadline_protocol(header_timeout_s: float, body_timeout_s: float, write_timeout_s: float,
                      keep_alive_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the deadlines uvicorn lacks (its keep-alive timer stops at the first byte of a
    request, and a write to a client that stopped reading waits forever): the request line and headers within
    header_timeout_s of the connection opening (on a kept-alive connection: of the next request's first byte), the
    body within body_timeout_s after them, and a response whose writes are stalled (kernel and transport buffers
    full) for write_timeout_s. Past any of them the connection is aborted; the app sees the client gone (a stream
    is cut: its generation is cancelled and its usage recorded as for any disconnect). An idle kept-alive
    connection is closed by uvicorn's keep-alive timer (`keep_alive_s`, the same value); the deadline armed after
    a response only backs it up."""

    class DeadlineH11Protocol(H11Protocol):
        _read_deadline: asyncio.TimerHandle | None = None
        _awaiting: str | None = None  # "headers", "body" or "idle" (between requests) while a deadline runs
        _write_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm("headers", header_timeout_s)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle and self.cycle is not None:  # a request's headers arrived
                if self.cycle.more_body:
                    self._arm("body", body_timeout_s)
                else:
                    self._disarm()
            elif self._awaiting == "body" and self.cycle is not None and not self.cycle.more_body:
                self._disarm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting == "idle":  # the next request on a kept-alive connection begins
                self._arm("headers", header_timeout_s)
            super().data_received(data)

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

    return DeadlineH11Protocol


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
