"""Callee side of a generate session (common.proto, SessionActions/SessionEvents): many Generate streams
on one bidirectional call.

Each opened stream runs the service's unchanged Generate handler as its own task, with a StreamSink in
place of the grpc ServicerContext (`write`, `invocation_metadata`). Its writes go to one outbox that a
single writer drains: whatever accumulated while the previous message was on the wire leaves together, so
at saturation a decode step's tokens for every request travel in one message. A cancel aborts the stream's
task (as a cancelled RPC would); a close does the same with the caller's StreamReport in the sink (`report`)
for the handler to read as it ends; the session ending cancels every task still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from flotilla.api.common.v1 import common_pb2 as pb

logger = logging.getLogger(__name__)

MAX_EVENTS_PER_MESSAGE = 4096  # a token chunk event is tens of bytes: far under the message size limit
Handler = Callable[[pb.GenerateRequest, "StreamSink"], Awaitable[None]]


class StreamSink:
    """What a Generate handler needs of its ServicerContext, for one stream of a session."""

    __slots__ = ("_outbox", "_stream_id", "_metadata", "report")

    def __init__(self, outbox: _Outbox, stream_id: int, metadata: tuple[tuple[str, str], ...]):
        self._outbox = outbox
        self._stream_id = stream_id
        self._metadata = metadata
        self.report: pb.StreamReport | None = None  # set by the caller's close, before the stream is cancelled

    async def write(self, response: pb.GenerateResponse) -> None:
        self.write_nowait(response)

    def write_nowait(self, response: pb.GenerateResponse) -> None:
        """The outbox never blocks: the same as write(), callable outside a coroutine."""
        self._outbox.put(pb.SessionEvent(stream_id=self._stream_id, response=response))

    def outgoing_response(self) -> pb.GenerateResponse:
        """A new, empty response already queued on this stream, for the caller to fill in at once (the writer
        takes it on a later turn of the loop): a token chunk is built in place, not copied into its event."""
        event = pb.SessionEvent(stream_id=self._stream_id)
        self._outbox.put(event)
        return event.response

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class _Outbox:
    """Events waiting for the session's writer; put() never blocks (the writer batches what piles up)."""

    def __init__(self) -> None:
        self._events: list[pb.SessionEvent] = []
        self._ready = asyncio.Event()
        self.closed = False

    def put(self, event: pb.SessionEvent) -> None:
        self._events.append(event)
        self._ready.set()

    async def take(self) -> list[pb.SessionEvent]:
        await self._ready.wait()
        if not self.closed:
            self._ready.clear()
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Nothing more will be put: the writer sends what is left and returns."""
        self.closed = True
        self._ready.set()


async def serve_session(actions: AsyncIterator[pb.SessionActions], context: grpc.aio.ServicerContext,
                        handler: Handler) -> None:
    """The body of a GenerateSession handler: returns once the caller half-closed and every stream ended."""
    outbox = _Outbox()
    tasks: dict[int, asyncio.Task] = {}
    sinks: dict[int, StreamSink] = {}
    writer = asyncio.create_task(_write_loop(outbox, context))
    try:
        async for message in actions:
            for closed in message.close:
                sink = sinks.get(closed.stream_id)
                if sink is not None:
                    sink.report = closed.report
            for stream_id in [*message.cancel, *(closed.stream_id for closed in message.close)]:
                task = tasks.pop(stream_id, None)
                if task is not None:
                    task.cancel()
            for opened in message.open:
                if opened.stream_id in tasks:
                    outbox.put(_end(opened.stream_id, grpc.StatusCode.ALREADY_EXISTS, "stream id in use"))
                    continue
                sink = StreamSink(outbox, opened.stream_id, tuple((m.key, m.value) for m in opened.metadata))
                task = asyncio.create_task(_run_stream(handler, opened, sink, outbox))
                tasks[opened.stream_id] = task
                sinks[opened.stream_id] = sink
                task.add_done_callback(lambda t, sid=opened.stream_id: _forget(sid, t, tasks, sinks))
        if tasks:  # the caller half-closed: its open streams still finish
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        outbox.close()
        await writer
    finally:
        for task in tasks.values():  # the caller went away (or we are shutting down): abort every stream
            task.cancel()
        writer.cancel()


def _forget(stream_id: int, task: asyncio.Task, tasks: dict[int, asyncio.Task],
            sinks: dict[int, StreamSink]) -> None:
    if tasks.get(stream_id) is task:
        del tasks[stream_id]
    if stream_id not in tasks:  # not reopened under the same id (a caller bug the open answers)
        sinks.pop(stream_id, None)


async def _run_stream(handler: Handler, opened: pb.SessionOpen, sink: StreamSink, outbox: _Outbox) -> None:
    code, details = grpc.StatusCode.OK, ""
    try:
        await handler(opened.request, sink)
    except asyncio.CancelledError:
        return  # cancelled by the caller or the session's end: nobody waits for an end marker
    except Exception as exc:  # a handler bug must not take the session's other streams with it
        logger.exception("stream %d (request %s) failed", opened.stream_id, opened.request.request_id)
        code, details = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    outbox.put(_end(opened.stream_id, code, details))


def _end(stream_id: int, code: grpc.StatusCode, details: str) -> pb.SessionEvent:
    return pb.SessionEvent(stream_id=stream_id, end=True, status_code=code.value[0], status_details=details)


async def _write_loop(outbox: _Outbox, context: grpc.aio.ServicerContext) -> None:
    while True:
        events = await outbox.take()
        if not events and outbox.closed:
            return
        for start in range(0, len(events), MAX_EVENTS_PER_MESSAGE):  # a slow reader lets many pile up
            await context.write(pb.SessionEvents(events=events[start:start + MAX_EVENTS_PER_MESSAGE]))
