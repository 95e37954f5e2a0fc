"""Reconnectable SSE streams, opt-in per request (an ASGI middleware around the app).

A streamed request with `x-flotilla-resumable: true` runs detached from its connection: its SSE events are
numbered (`id: <stream id>.<n>`) and kept; the answer carries `x-flotilla-stream-id`. When the connection
drops, the generation goes on for a grace period (default 30 s); a client that reconnects within it gets
every event after the one it names, then the rest live:

    GET /v1/streams/<stream id>            Last-Event-ID: <stream id>.<n>   (same API key)
    or the original POST again             Last-Event-ID: <stream id>.<n>

No reconnect within the grace period: the request is cancelled as if the client had gone (the engine aborts
it). Without the opt-in nothing changes: a disconnect cancels at once. Streams live in this gateway's memory:
a reconnect must reach the same gateway process (sticky routing by stream id in front of several gateways).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flotilla.gateway.body import body_too_large, read_asgi_body
from flotilla.gateway.dialects import dialect_for_path, error_response
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.generation import wait_for_disconnect
from flotilla.gateway.idempotency import GENERATION_PATHS

log = logging.getLogger(__name__)

OPT_IN_HEADER = b"x-flotilla-resumable"
STREAM_ID_HEADER = b"x-flotilla-stream-id"
LAST_EVENT_ID_HEADER = b"last-event-id"
RECONNECT_PREFIX = "/v1/streams/"
MAX_EVENT_INDEX_DIGITS = 9


@dataclass(eq=False)
class _Stream:
    stream_id: str
    caller: str  # hash of the credential that started it; a reconnect must present the same one
    path: str
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    events: list[bytes] = field(default_factory=list)  # encoded, with their id lines
    is_sse: bool = False
    done: bool = False
    num_clients: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned: asyncio.Event = field(default_factory=asyncio.Event)  # tells the app its client is gone
    pending: bytes = b""  # SSE bytes not yet split into events
    expiry: asyncio.Task | None = None

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def add_bytes(self, data: bytes) -> None:
        if not self.is_sse:
            self.events.append(data)
            return
        self.pending += data
        while (end := _event_end(self.pending)) is not None:
            block, separator = self.pending[: end[0]], self.pending[end[0]: end[1]]
            self.pending = self.pending[end[1]:]
            if block and not all(line.startswith(b":") for line in block.splitlines()):  # pings are not kept
                event_id = f"{self.stream_id}.{len(self.events) + 1}".encode()
                self.events.append(b"id: " + event_id + separator[: len(separator) // 2] + block + separator)


class ResumableStreamMiddleware:
    def __init__(self, app: ASGIApp, grace_s: float = 30.0, max_body_bytes: int = 4 * 1024 * 1024):
        self.app = app
        self.grace_s = grace_s
        self.max_body_bytes = max_body_bytes  # read before the app authenticates: never more than this
        self.streams: dict[str, _Stream] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if scope["method"] == "GET" and scope["path"].startswith(RECONNECT_PREFIX):
            await self._reconnect(scope, receive, send, scope["path"][len(RECONNECT_PREFIX):], headers)
        elif scope["method"] == "POST" and scope["path"] in GENERATION_PATHS and LAST_EVENT_ID_HEADER in headers:
            stream_id = headers[LAST_EVENT_ID_HEADER].decode("latin-1").rpartition(".")[0]
            await self._reconnect(scope, receive, send, stream_id, headers)
        elif (scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
              and headers.get(OPT_IN_HEADER, b"").strip().lower() in (b"1", b"true", b"yes")):
            await self._start(scope, receive, send, headers)
        else:
            await self.app(scope, receive, send)

    # ---- a new resumable request ----------------------------------------------------------------------
    async def _start(self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes]) -> None:
        body, _ = await read_asgi_body(receive, self.max_body_bytes)
        if len(body) > self.max_body_bytes:
            await _refuse(scope, send, body_too_large(len(body), self.max_body_bytes))
            return
        stream = _Stream(uuid.uuid4().hex, _caller(headers), scope["path"])
        self.streams[stream.stream_id] = stream
        producer = asyncio.create_task(self._produce(stream, scope, body))
        try:
            await self._serve(stream, 0, receive, send)
        finally:
            if not stream.is_sse:  # an error answer (not a stream): nothing to resume
                await producer
                self.streams.pop(stream.stream_id, None)

    async def _produce(self, stream: _Stream, scope: Scope, body: bytes) -> None:
        """Runs the app detached from any connection; its receive reports a disconnect only when abandoned."""
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await stream.abandoned.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                stream.status = message["status"]
                stream.headers = list(message.get("headers", []))
                content_type = dict(stream.headers).get(b"content-type", b"")
                stream.is_sse = stream.status == 200 and content_type.startswith(b"text/event-stream")
                stream.started.set()
            elif message["type"] == "http.response.body":
                stream.add_bytes(message.get("body", b""))
                stream.notify()

        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("resumable stream %s failed", stream.stream_id)
        finally:
            stream.done = True
            stream.started.set()
            stream.notify()
            if stream.num_clients == 0:
                self._expire_later(stream)

    # ---- serving a connection -------------------------------------------------------------------------
    async def _serve(self, stream: _Stream, after: int, receive: Receive, send: Send) -> None:
        """Send the events after index `after`, then the live ones, until the end or a disconnect."""
        stream.num_clients += 1
        if stream.expiry is not None:
            stream.expiry.cancel()
            stream.expiry = None
        gone = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await stream.started.wait()
            headers = stream.headers
            if stream.is_sse:
                headers = [*headers, (STREAM_ID_HEADER, stream.stream_id.encode())]
            await send({"type": "http.response.start", "status": stream.status, "headers": headers})
            index = after
            while not gone.done():
                while index < len(stream.events):
                    await send({"type": "http.response.body", "body": stream.events[index], "more_body": True})
                    index += 1
                if stream.done and index >= len(stream.events):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                changed = asyncio.ensure_future(stream.changed.wait())
                await asyncio.wait({changed, gone}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
        finally:
            gone.cancel()
            stream.num_clients -= 1
            if stream.num_clients == 0:
                self._expire_later(stream)

    def _expire_later(self, stream: _Stream) -> None:
        """No client now: after the grace period, cancel the generation (if still running) and forget it."""
        if stream.expiry is None and stream.stream_id in self.streams:
            stream.expiry = asyncio.get_running_loop().create_task(self._expire(stream))

    async def _expire(self, stream: _Stream) -> None:
        await asyncio.sleep(self.grace_s)
        if stream.num_clients == 0:
            if not stream.done:
                log.info("resumable stream %s: no reconnect within %.0f s, cancelling", stream.stream_id,
                         self.grace_s)
            stream.abandoned.set()
            self.streams.pop(stream.stream_id, None)

    # ---- reconnects -----------------------------------------------------------------------------------
    async def _reconnect(self, scope: Scope, receive: Receive, send: Send, stream_id: str,
                         headers: dict[bytes, bytes]) -> None:
        stream = self.streams.get(stream_id)
        if stream is None or stream.caller != _caller(headers) or not stream.is_sse:
            await _not_found(scope, send, stream_id)
            return
        last = headers.get(LAST_EVENT_ID_HEADER, b"").decode("latin-1")
        prefix, _, number = last.rpartition(".")
        # An event index is a short ASCII number; anything else (10,000 digits, other scripts' digits) means 0.
        is_index = number.isascii() and number.isdigit() and len(number) <= MAX_EVENT_INDEX_DIGITS
        after = int(number) if is_index and prefix in ("", stream_id) else 0
        body, _ = await read_asgi_body(receive, self.max_body_bytes)
        if len(body) > self.max_body_bytes:
            await _refuse(scope, send, body_too_large(len(body), self.max_body_bytes))
            return
        await self._serve(stream, min(after, len(stream.events)), receive, send)


def _event_end(data: bytes) -> tuple[int, int] | None:
    """(start, end) of the first blank line that ends an event; SSE lines end in CRLF, LF or CR."""
    found = [(i, i + len(sep)) for sep in (b"\r\n\r\n", b"\n\n", b"\r\r") if (i := data.find(sep)) >= 0]
    return min(found) if found else None


def _caller(headers: dict[bytes, bytes]) -> str:
    credential = headers.get(b"x-api-key") or headers.get(b"authorization") or b""
    return hashlib.sha256(credential.strip()).hexdigest()


async def _not_found(scope: Scope, send: Send, stream_id: str) -> None:
    await _refuse(scope, send, GatewayError(
        ErrorKind.NOT_FOUND, f"no resumable stream {stream_id!r} here (ended more than the grace period ago, never "
        "existed, or started with another API key)", param="Last-Event-ID"))


async def _refuse(scope: Scope, send: Send, err: GatewayError) -> None:
    path = scope["path"] if scope["path"] in GENERATION_PATHS else "/v1/chat/completions"
    response = error_response(dialect_for_path(path), err, 1)

    async def no_receive() -> Message:
        return {"type": "http.disconnect"}

    await response({"type": "http"}, no_receive, send)
