"""Caller side of a generate session (common.proto): `generate()` returns a SessionStream that behaves like
the call object of a unary-request Generate (async iteration, `cancel()`, grpc.aio.AioRpcError on
failure), while every stream shares one bidirectional call per peer.

One reader task hands each arriving SessionEvents message out to the streams it names; one writer task
sends opens and cancels (batched like the events). When the call fails or ends, every open stream fails
with the call's status (UNAVAILABLE when the peer vanished: what a per-request call would have said), and
the next generate() opens a new session.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.inbox import Inbox

OpenCall = Callable[[], grpc.aio.StreamStreamCall]  # e.g. stub.GenerateSession
DirectHandler = Callable[[pb.GenerateResponse], bool]
MAX_ACTIONS_BYTES = 8 << 20  # well under the channels' message limit (rpc/options.py)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SessionStream:
    """One Generate stream on a session: `async for response in stream`, `stream.cancel()`."""

    def __init__(self, session: _Session, stream_id: int, deadline: float | None):
        self._session = session
        self.stream_id = stream_id
        self._inbox: Inbox[pb.SessionEvent | grpc.aio.AioRpcError] = Inbox(f"stream {stream_id}")
        self._done = False
        # The caller's timeout: one timer for the stream's life (a timeout around every read would cost a
        # timer per token); when it fires, the stream reads DEADLINE_EXCEEDED next and the callee is told.
        self._deadline_timer = (None if deadline is None
                                else asyncio.get_running_loop().call_at(deadline, self._deadline_passed))

    def deliver_directly(self, handler: DirectHandler | None) -> None:
        """While set, a response goes to `handler` in the session's reader, instead of waking the stream's
        reader, when it arrives while that reader waits with nothing in hand (engine/inbox.py). Ends and errors
        always go to iteration."""
        self._inbox.deliver_directly(handler)

    def deliver(self, event: pb.SessionEvent | grpc.aio.AioRpcError) -> None:
        inbox = self._inbox
        if (inbox.handler is not None and type(event) is pb.SessionEvent and not event.end
                and inbox.try_deliver_directly(event.response)):
            return
        inbox.put(event)

    def __aiter__(self) -> SessionStream:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        if self._done:
            raise StopAsyncIteration
        await self._inbox.wait()
        return self._take(self._inbox.items.popleft())

    def next_ready(self) -> pb.GenerateResponse | None:
        """The next response if it has already arrived, without waiting; None when nothing has, or when
        what comes next is the stream's end or an error (the next iteration reports those)."""
        events = self._inbox.items
        if self._done or not events:
            return None
        event = events[0]
        if isinstance(event, grpc.aio.AioRpcError) or event.end:
            return None
        events.popleft()
        return event.response

    def _take(self, event: pb.SessionEvent | grpc.aio.AioRpcError) -> pb.GenerateResponse:
        if isinstance(event, grpc.aio.AioRpcError):
            self._finish()
            if event.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._session.cancel(self.stream_id)
            raise event
        if not event.end:
            return event.response
        self._finish()
        if event.status_code:
            raise rpc_error(_status(event.status_code), event.status_details)
        raise StopAsyncIteration

    def _deadline_passed(self) -> None:
        if not self._done:
            self.deliver(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self, report: pb.StreamReport | None = None) -> bool:
        """Tell the callee to abort the stream (with the caller's account of it, when given: a close); False
        when it had already ended."""
        if self._done:
            return False
        self._finish()
        self._session.cancel(self.stream_id, report)
        return True

    def done(self) -> bool:
        return self._done

    def _finish(self) -> None:
        self._done = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._session.forget(self.stream_id)


class SessionClient:
    """Generate streams to one peer over a session that is (re)opened on demand."""

    def __init__(self, open_call: OpenCall):
        self._open_call = open_call
        self._session: _Session | None = None
        self._stream_ids = itertools.count(1)

    def generate(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str]] | None = None,
                 timeout: float | None = None) -> SessionStream:
        if self._session is None or self._session.ended:
            self._session = _Session(self._open_call())
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        return self._session.open(next(self._stream_ids), request, metadata or (), deadline)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class _Session:
    def __init__(self, call: grpc.aio.StreamStreamCall):
        self._call = call
        self._streams: dict[int, SessionStream] = {}
        self._pending = pb.SessionActions()
        self._has_pending = asyncio.Event()
        self.ended = False
        self._reader = asyncio.create_task(self._read_loop())
        self._writer = asyncio.create_task(self._write_loop())

    def open(self, stream_id: int, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str]],
             deadline: float | None) -> SessionStream:
        stream = SessionStream(self, stream_id, deadline)
        self._streams[stream_id] = stream
        opened = self._pending.open.add(stream_id=stream_id, request=request)
        for key, value in metadata:
            opened.metadata.add(key=key, value=value)
        self._has_pending.set()
        return stream

    def cancel(self, stream_id: int, report: pb.StreamReport | None = None) -> None:
        if not self.ended:
            if report is None:
                self._pending.cancel.append(stream_id)
            else:
                self._pending.close.add(stream_id=stream_id, report=report)
            self._has_pending.set()

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    def close(self) -> None:
        self._end(rpc_error(grpc.StatusCode.CANCELLED, "session closed"))
        self._call.cancel()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._has_pending.wait()
                self._has_pending.clear()
                actions, self._pending = self._pending, pb.SessionActions()
                for message in _split(actions):
                    await self._call.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the reader sees the call's end and fails the streams

    async def _read_loop(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "session ended by the peer")
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                for event in message.events:
                    stream = self._streams.get(event.stream_id)
                    if stream is not None:
                        stream.deliver(event)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "session closed")
        finally:
            self._end(error)

    def _end(self, error: grpc.aio.AioRpcError) -> None:
        if self.ended:
            return
        self.ended = True
        self._writer.cancel()
        for stream in list(self._streams.values()):
            stream.deliver(error)
        self._streams.clear()


def _split(actions: pb.SessionActions) -> list[pb.SessionActions]:
    """Opens batched into messages of at most MAX_ACTIONS_BYTES (long prompts travel in them), cancels first."""
    messages = [pb.SessionActions(cancel=actions.cancel, close=actions.close)]
    size = 0
    for opened in actions.open:
        num_bytes = opened.ByteSize()
        if size and size + num_bytes > MAX_ACTIONS_BYTES:
            messages.append(pb.SessionActions())
            size = 0
        messages[-1].open.append(opened)
        size += num_bytes
    return messages


_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def _status(value: int) -> grpc.StatusCode:
    return _STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
