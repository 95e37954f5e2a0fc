"""SSE plumbing shared by the dialects.

The first event is awaited before the 200 goes out, so that a request refused by the router still gets
its proper status and error body. After that, SSEResponse writes each event (pre-encoded bytes) straight
to the ASGI `send`: one send per event and nothing else per token (a generic SSE response wraps every
send in a timeout and a cancel scope, a measurable share of the gateway's CPU per token). A watcher task
ends the stream when the client disconnects, and a pinger keeps idle connections alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from flotilla.gateway.generation import Events, next_event, until_disconnected, wait_for_disconnect
from flotilla.rpc.stream_events import Chunk, Finished
PING_INTERVAL_S = 15.0
COMMENT_PING = b": ping\n\n"  # ignored by every SSE client; the Anthropic dialect sends its own ping event


def sse_json(payload: object, event: str | None = None) -> bytes:
    """One SSE event whose data is `payload` as compact JSON (UTF-8, as SSE requires)."""
    data = orjson.dumps(payload)
    if event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def sse_data(text: str) -> bytes:
    return b"data: " + text.encode() + b"\n\n"


async def first_event(request: Request, events: Events) -> Chunk | Finished:
    try:
        return await until_disconnected(request, next_event(events))
    except BaseException:
        await events.aclose()
        raise


class SSEResponse(Response):
    """Streams `body_iterator` (encoded SSE events). The iterator is closed however the stream ends (its
    end, the client gone, the server cancelling), so its cleanup, cancelling the router call, always runs."""

    media_type = "text/event-stream"

    def __init__(self, body_iterator: AsyncGenerator[bytes, None], ping: bytes = COMMENT_PING,
                 ping_interval_s: float = PING_INTERVAL_S):
        self.body_iterator = body_iterator
        self.ping = ping
        self.ping_interval_s = ping_interval_s
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})  # no proxy buffering
        self._last_send = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        self._last_send = loop.time()
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        pinger = asyncio.ensure_future(self._ping_while_idle(send))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watcher, pinger):
                task.cancel()
            await asyncio.gather(pump, watcher, pinger, return_exceptions=True)
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()

    async def _pump(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for data in self.body_iterator:
                self._last_send = loop.time()
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.body_iterator.aclose()

    async def _ping_while_idle(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            idle_s = loop.time() - self._last_send
            if idle_s >= self.ping_interval_s:
                self._last_send = loop.time()
                await send({"type": "http.response.body", "body": self.ping, "more_body": True})
                idle_s = 0.0
            await asyncio.sleep(self.ping_interval_s - idle_s)
