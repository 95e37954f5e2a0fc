"""A batch-generate session (router.proto, BatchGenerateSession): many one-input calls of fixed-batch models
on one bidirectional stream, each answered by exactly one BatchResult with the same call id.

Caller side, `BatchSessionClient.call(BatchCall) -> BatchResult`: one writer sends the calls (and cancels)
that piled up meanwhile in one message, one reader resolves each call's future; when the stream ends every
unanswered call fails with the stream's status (UNAVAILABLE when the peer vanished), and the next call opens a
new session. Callee side, `serve_batch_session(calls, context, submit, cancel)`: each call goes to `submit`
with a resolve callback; results that accumulate while a message is on the wire leave together.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

import grpc

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.rpc.session_client import rpc_error

OpenCall = Callable[[], grpc.aio.StreamStreamCall]  # stub.BatchGenerateSession
Handle = TypeVar("Handle")
MAX_RESULTS_PER_MESSAGE = 4096


class BatchSessionClient:
    def __init__(self, open_call: OpenCall):
        self._open_call = open_call
        self._session: _ClientSession | None = None
        self._call_ids = itertools.count(1)

    async def call(self, call: rpb.BatchCall) -> rpb.BatchResult:
        """The call's result; raises grpc.aio.AioRpcError when the session fails first. Cancelling the awaiting
        task cancels the call at the router."""
        if self._session is None or self._session.ended:
            self._session = _ClientSession(self._open_call())
        session = self._session
        call.call_id = next(self._call_ids)
        future = session.send(call)
        try:
            return await future
        except asyncio.CancelledError:
            session.cancel(call.call_id)
            raise

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class _ClientSession:
    def __init__(self, call: grpc.aio.StreamStreamCall):
        self._call = call
        self._futures: dict[int, asyncio.Future[rpb.BatchResult]] = {}
        self._pending = rpb.BatchCalls()
        self._has_pending = asyncio.Event()
        self.ended = False
        self._reader = asyncio.create_task(self._read_loop())
        self._writer = asyncio.create_task(self._write_loop())

    def send(self, call: rpb.BatchCall) -> asyncio.Future[rpb.BatchResult]:
        future = asyncio.get_running_loop().create_future()
        self._futures[call.call_id] = future
        self._pending.calls.append(call)
        self._has_pending.set()
        return future

    def cancel(self, call_id: int) -> None:
        if self._futures.pop(call_id, None) is not None and not self.ended:
            self._pending.cancel.append(call_id)
            self._has_pending.set()

    def close(self) -> None:
        self._end(rpc_error(grpc.StatusCode.CANCELLED, "session closed"))
        self._call.cancel()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._has_pending.wait()
                self._has_pending.clear()
                message, self._pending = self._pending, rpb.BatchCalls()
                await self._call.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the reader sees the call's end and fails the calls

    async def _read_loop(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "batch session ended by the router")
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                for result in message.results:
                    future = self._futures.pop(result.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(result)
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
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()


async def serve_batch_session(calls: AsyncIterator[rpb.BatchCalls], context: grpc.aio.ServicerContext,
                              submit: Callable[[rpb.BatchCall, Callable[[rpb.BatchResult], None]], Handle | None],
                              cancel: Callable[[Handle, rpb.BatchCall], None]) -> None:
    """The body of a BatchGenerateSession handler; returns once the caller half-closed and every call was
    answered. The caller going away cancels every call still open."""
    outbox: list[rpb.BatchResult] = []
    ready = asyncio.Event()
    open_calls: dict[int, tuple[Handle, rpb.BatchCall]] = {}
    closing = False

    def resolver(call_id: int) -> Callable[[rpb.BatchResult], None]:
        def resolve(result: rpb.BatchResult) -> None:
            open_calls.pop(call_id, None)
            result.call_id = call_id
            outbox.append(result)
            ready.set()
        return resolve

    async def write_loop() -> None:
        while True:
            await ready.wait()
            ready.clear()
            results = outbox[:]
            outbox.clear()
            for start in range(0, len(results), MAX_RESULTS_PER_MESSAGE):
                await context.write(rpb.BatchResults(results=results[start:start + MAX_RESULTS_PER_MESSAGE]))
            if closing and not open_calls and not outbox:
                return

    writer = asyncio.create_task(write_loop())
    try:
        async for message in calls:
            for call_id in message.cancel:
                held = open_calls.pop(call_id, None)
                if held is not None:
                    cancel(*held)
            for call in message.calls:
                if call.call_id in open_calls:
                    continue  # a duplicate id: the first call keeps it
                handle = submit(call, resolver(call.call_id))
                if handle is not None:  # queued: answered later, never inside submit
                    open_calls[call.call_id] = (handle, call)
        closing = True
        ready.set()
        await writer
    finally:
        for handle, call in list(open_calls.values()):
            cancel(handle, call)
        writer.cancel()
