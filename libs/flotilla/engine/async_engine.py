"""The engine on its own thread, driven from asyncio.

Engine steps block for milliseconds to seconds, so they never run on the event loop. The loop hands adds and
aborts to the engine thread through a command list guarded by a condition; the thread applies them between
steps and sleeps on the condition while there is nothing to do (no busy spin). Each step's outputs go back to
the loop in one `call_soon_threadsafe` call and land in per-request asyncio queues; a consumer that finds
several outputs waiting gets them merged into one (several tokens per gRPC message).

Contract: `await generate(new_request)` raises InvalidRequestError / ContextLengthError in the caller before any
token is produced, then returns a RequestStream. A stream that is closed or whose consumer is cancelled
before the request finished aborts it in the engine at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from flotilla.engine.engine import LLMEngine
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.inbox import Inbox
from flotilla.engine.new_request import NewRequest
from flotilla.engine.outputs import EngineStats, RequestOutput
from flotilla.engine.request import FinishReason
from flotilla.engine.stream_pacer import StreamPacer

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], LLMEngine]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); no new requests are taken."""


class EngineSnapshot(NamedTuple):
    """Load figures taken on the engine thread after each step, read lock-free from the loop."""

    stats: EngineStats
    active_request_ids: tuple[str, ...]


@dataclass
class _Add:
    request_id: str
    stream: RequestStream
    ack: asyncio.Future[None]
    new: NewRequest | None = None  # what to queue, or:
    prefilled: Prefilled | None = None  # a remote prefill's request and first token: admit it as running


class Prefilled(NamedTuple):
    """A request whose prompt K/V a prefill worker wrote into its reserved blocks, and its first token."""

    request: Any  # flotilla.engine.request.Request, its blocks reserved by remote_prefill.try_reserve
    first_token_id: int
    logprobs: Any = None  # TokenLogprobs of the first token, when asked for


@dataclass
class _Call:
    """Run fn(engine) on the engine thread between steps; its result (or exception) goes to ack."""

    fn: Callable[[LLMEngine], Any]
    ack: asyncio.Future[Any]


@dataclass
class _Abort:
    request_id: str
    ack: asyncio.Future[bool] | None = None


_ABORTED = object()  # queue marker: the engine dropped the request (abort or shutdown)


class StreamOwner:
    """What AsyncEngine and ProcessEngine (process_engine.py) share on the loop side: the open streams by request
    id, the add that opens one, and the load snapshot the engine last sent. A subclass says how an add reaches
    its engine (`_submit_add`) and whether the engine runs (`_check_running`)."""

    def __init__(self) -> None:
        self._snapshot: EngineSnapshot | None = None
        self._streams: dict[str, RequestStream] = {}  # loop side: open streams, for duplicate ids

    def snapshot(self) -> EngineSnapshot:
        if self._snapshot is None:
            raise RuntimeError(f"{type(self).__name__} not started")
        return self._snapshot

    def stats(self) -> EngineStats:
        return self.snapshot().stats

    def active_request_ids(self) -> tuple[str, ...]:
        return self.snapshot().active_request_ids

    async def generate(self, new: NewRequest) -> RequestStream:
        """Add a request; raises InvalidRequestError here if the engine refuses it, else returns its stream."""
        self._check_running()
        if not new.request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        stream = self._new_stream(new.request_id, len(new.prompt_token_ids) + len(new.delivered_token_ids))
        return await self._added(stream, self._submit_add(new, stream))

    def _new_stream(self, request_id: str, num_prompt_tokens: int) -> RequestStream:
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        stream = RequestStream(self, request_id, num_prompt_tokens)
        self._streams[request_id] = stream
        return stream

    async def _added(self, stream: RequestStream, ack: asyncio.Future[None]) -> RequestStream:
        """`stream` once the engine acknowledged its add; a refused add forgets it, a cancelled wait aborts it."""
        try:
            await ack
        except asyncio.CancelledError:
            stream.close()  # the add may have gone through: abort it
            raise
        except BaseException:
            self._forget(stream)
            raise
        return stream

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _check_running(self) -> None:
        raise NotImplementedError

    def _submit_add(self, new: NewRequest, stream: RequestStream) -> asyncio.Future[None]:
        raise NotImplementedError

    def _abort_soon(self, request_id: str) -> None:
        raise NotImplementedError


class AsyncEngine(StreamOwner):
    def __init__(self, engine_factory: EngineFactory, check_integrity_when_idle: bool = True,
                 stream_interval_s: float = 0.0):
        """`stream_interval_s`: release running requests' tokens at most this often (stream_pacer.py)."""
        super().__init__()
        self._pacer = StreamPacer(stream_interval_s)
        self._factory = engine_factory
        self._check_integrity_when_idle = check_integrity_when_idle
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Call] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._closed = False  # guarded by _cond: the thread has exited
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: LLMEngine | None = None
        self._failure: BaseException | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._active: dict[str, RequestStream] = {}  # engine-thread side: requests the engine holds
        self.integrity_ok = True

    # ---- lifecycle (loop side) ---------------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine on its thread (model loading blocks too) and return once it is ready."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = self._loop.create_future()
        self._stopped = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="flotilla-engine", daemon=True)
        self._thread.start()
        await started

    async def shutdown(self) -> None:
        """Abort what is running, stop the thread and wait for it; open streams end with ABORT."""
        if self._thread is None or self._stopped is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.shield(self._stopped)
        await asyncio.to_thread(self._thread.join)

    @property
    def engine(self) -> LLMEngine:
        """The engine, for its read-only attributes (model_config, tokenizer, max_model_len, model_version)."""
        if self._engine is None:
            raise RuntimeError("AsyncEngine not started")
        return self._engine

    @property
    def is_running(self) -> bool:
        return self._engine is not None and self._failure is None and not self._stopping

    # ---- requests (loop side) ----------------------------------------------------------------------
    def _submit_add(self, new: NewRequest, stream: RequestStream) -> asyncio.Future[None]:
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._submit(_Add(new.request_id, stream, ack, new=new))
        return ack

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result (or raise its error)."""
        self._check_running()
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._submit(_Call(fn, ack))
        return await ack

    async def generate_prefilled(self, prefilled: Prefilled) -> RequestStream:
        """Admit a remotely prefilled request into the running batch; its stream starts with the first token."""
        self._check_running()
        request = prefilled.request
        stream = self._new_stream(request.request_id, request.num_prompt_tokens)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._submit(_Add(request.request_id, stream, ack, prefilled=prefilled))
        return await self._added(stream, ack)  # cancelled: the engine admits it anyway (or frees it), then aborts

    async def abort(self, request_id: str) -> bool:
        """Abort a request now; its stream ends with an ABORT output. False if the engine did not hold it."""
        self._check_running()
        ack: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._submit(_Abort(request_id, ack))
        return await ack

    def _check_running(self) -> None:
        if self._engine is None:
            raise EngineDeadError("AsyncEngine not started")
        if self._failure is not None or self._stopping:
            raise EngineDeadError(f"engine stopped: {self._failure or 'shutdown'}")

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        with self._cond:
            if not self._closed:
                self._commands.append(command)
                self._cond.notify()
                return
        _settle(command.ack, None, EngineDeadError("engine stopped"))

    def _abort_soon(self, request_id: str) -> None:
        if self._failure is None and not self._stopping:
            self._submit(_Abort(request_id))

    # ---- engine thread -----------------------------------------------------------------------------
    def _run(self, started: asyncio.Future[None]) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # report any start-up failure to start()'s caller
            self._failure = exc
            self._call_soon(_settle, started, None, exc)
            self._call_soon(_settle, self._stopped, None, None)
            return
        self._engine = engine
        self._take_snapshot(engine)
        self._call_soon(_settle, started, None, None)
        try:
            self._serve(engine)
        except BaseException as exc:
            logger.exception("engine thread failed; failing every open request")
            self._failure = exc
            failed = list(self._active.values())
            self._active.clear()
            self._call_soon(_push_all, failed, EngineDeadError(f"engine failed: {exc!r}"))
        finally:
            with self._cond:  # whatever arrived too late is refused, so that no caller waits forever
                self._closed = True
                leftover, self._commands = self._commands, []
            self._call_soon(_settle_all, [_Ack(c.ack, None, EngineDeadError("engine stopped")) for c in leftover])
            self._call_soon(_settle, self._stopped, None, None)

    def _serve(self, engine: LLMEngine) -> None:
        needs_check = False
        while True:
            commands, stopping = self._next_commands(engine)
            engine.release_expired_quarantine()  # aborted hand-offs' blocks, on an idle engine too
            acks = [self._apply(engine, command) for command in commands]
            if commands:
                # Snapshot before acking, so that a caller whose add or abort returned sees it in stats.
                self._take_snapshot(engine)
                self._call_soon(_settle_all, acks)
            if stopping:
                self._abort_all(engine)
                return
            if engine.has_unfinished_requests():
                deliveries = self._pacer.pace(self._step(engine))
                self._take_snapshot(engine)  # before the outputs: whoever saw an output sees its load too
                if deliveries:
                    self._call_soon(_deliver, deliveries)
                needs_check = True
            if needs_check and not engine.has_unfinished_requests():
                needs_check = False
                self._check_integrity(engine)

    def _next_commands(self, engine: LLMEngine) -> tuple[list[_Add | _Abort | _Call], bool]:
        with self._cond:
            while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                release_at = engine.next_quarantine_release()  # an idle engine wakes to end a quarantine
                if release_at is not None and release_at <= time.monotonic():
                    break
                self._cond.wait(None if release_at is None else release_at - time.monotonic())
            commands, self._commands = self._commands, []
            return commands, self._stopping

    def _apply(self, engine: LLMEngine, command: _Add | _Abort | _Call) -> _Ack:
        """Apply one command; returns the answer for its waiter, sent once the snapshot is updated."""
        if isinstance(command, _Abort):
            stream = self._active.pop(command.request_id, None)
            found = engine.abort(command.request_id)
            if stream is not None:
                self._pacer.drop(stream)
                self._call_soon(stream._push, _ABORTED)
            return _Ack(command.ack, found, None)
        if isinstance(command, _Call):
            try:
                return _Ack(command.ack, command.fn(engine), None)
            except Exception as exc:  # back to the caller, not the thread
                return _Ack(command.ack, None, exc)
        if command.prefilled is not None:
            return self._apply_prefilled(engine, command)
        try:
            engine.add_request(command.new)
        except Exception as exc:  # validation errors (and bugs) go back to the caller, not the thread
            return _Ack(command.ack, None, exc)
        self._active[command.request_id] = command.stream
        return _Ack(command.ack, None, None)

    def _apply_prefilled(self, engine: LLMEngine, command: _Add) -> _Ack:
        prefilled = command.prefilled
        try:
            output = engine.add_prefilled_request(prefilled.request, prefilled.first_token_id, prefilled.logprobs)
        except Exception as exc:
            return _Ack(command.ack, None, exc)
        if not output.finished:
            self._active[command.request_id] = command.stream
        self._call_soon(command.stream._push, output)
        return _Ack(command.ack, None, None)

    def _step(self, engine: LLMEngine) -> list[tuple[RequestStream, RequestOutput]]:
        outputs = engine.step()
        deliveries = []
        for output in outputs:
            stream = self._active.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._active[output.request_id]
            deliveries.append((stream, output))
        return deliveries

    def _abort_all(self, engine: LLMEngine) -> None:
        for request_id, stream in list(self._active.items()):
            engine.abort(request_id)
            self._call_soon(stream._push, _ABORTED)
        self._active.clear()
        self._pacer.clear()
        self._take_snapshot(engine)

    def _take_snapshot(self, engine: LLMEngine) -> None:
        self._snapshot = EngineSnapshot(engine.stats(), tuple(self._active))

    def _check_integrity(self, engine: LLMEngine) -> None:
        if not self._check_integrity_when_idle:
            return
        self.integrity_ok = engine.check_integrity()
        if not self.integrity_ok:
            logger.error("KV block accounting is inconsistent while idle (free + cached + used != total)")

    def _call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class RequestStream:
    """Async iterator over one request's outputs; outputs waiting together come out merged into one."""

    def __init__(self, owner: StreamOwner, request_id: str, num_prompt_tokens: int):
        self.request_id = request_id
        self._owner = owner
        self._inbox: Inbox[Any] = Inbox(f"request {request_id}")  # outputs, _ABORTED or an exception
        self._done = False  # finished or closed: no more outputs
        self._num_prompt_tokens = num_prompt_tokens
        self._num_cached_prompt_tokens = 0
        self._num_output_tokens = 0

    @property
    def finished(self) -> bool:
        return self._done

    def deliver_directly(self, handler: Callable[[RequestOutput], bool] | None) -> None:
        """While set, an output that does not end the request goes to `handler` on the loop, instead of waking
        the consumer, when it arrives while the consumer waits with nothing in hand (engine/inbox.py). The
        last output, aborts and errors always go to iteration."""
        self._inbox.deliver_directly(handler)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        inbox = self._inbox
        try:
            await inbox.wait()
        except asyncio.CancelledError:
            self.close()  # the consumer went away: abort in the engine
            raise
        items = list(inbox.items)
        inbox.items.clear()
        return self._merge(items)

    def close(self) -> None:
        """Stop reading; aborts the request in the engine if it has not finished."""
        if self._done:
            return
        self._done = True
        self._owner._forget(self)
        self._owner._abort_soon(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def _push(self, item: Any) -> None:
        inbox = self._inbox
        if (inbox.handler is not None and not self._done and type(item) is RequestOutput and not item.finished
                and inbox.try_deliver_directly(item)):
            self._num_cached_prompt_tokens = item.num_cached_prompt_tokens
            self._num_output_tokens = item.num_output_tokens
            return
        inbox.put(item)

    def _merge(self, items: list[Any]) -> RequestOutput:
        outputs: list[RequestOutput] = []
        for item in items:
            if isinstance(item, BaseException):
                self._end()
                raise item
            output = self._aborted_output() if item is _ABORTED else item
            self._num_cached_prompt_tokens = output.num_cached_prompt_tokens
            self._num_output_tokens = output.num_output_tokens
            outputs.append(output)
            if output.finished:
                self._end()
                break
        return merge_outputs(outputs)

    def _aborted_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason=FinishReason.ABORT,
            stop_reason=None,
            num_prompt_tokens=self._num_prompt_tokens,
            num_cached_prompt_tokens=self._num_cached_prompt_tokens,
            num_output_tokens=self._num_output_tokens,
        )

    def _end(self) -> None:
        self._done = True
        self._owner._forget(self)


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: tokens, text and logprobs joined; the rest from the last."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        text_delta="".join(o.text_delta for o in outputs),
        finished=last.finished,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_cached_prompt_tokens=last.num_cached_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        logprobs=[lp for o in outputs for lp in o.logprobs],
    )


class _Ack(NamedTuple):
    future: asyncio.Future[Any] | None
    result: Any
    exc: BaseException | None


# Loop-side callbacks scheduled from the engine thread.
def _settle_all(acks: list[_Ack]) -> None:
    for ack in acks:
        _settle(*ack)


def _settle(future: asyncio.Future[Any] | None, result: Any, exc: BaseException | None) -> None:
    if future is None or future.done():  # a cancelled waiter no longer wants the answer
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _deliver(deliveries: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in deliveries:
        stream._push(output)


def _push_all(streams: list[RequestStream], item: Any) -> None:
    for stream in streams:
        stream._push(item)
