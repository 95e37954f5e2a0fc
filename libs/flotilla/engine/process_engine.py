"""The engine in a process of its own, driven from asyncio: AsyncEngine's surface over two pipes.

In a worker with the engine on a thread (async_engine.py), every step shares one GIL with the gRPC event
loop that streams its tokens: on a core of its own the engine still waits for the loop's ~8% of the GIL
(performance.md). Here the step loop runs in a child process (engine_core.py) and the worker's loop only
handles one message per engine turn (acks, outputs, aborts and the load snapshot), read from a pipe by a
thread, so the two run on different cores without taking turns.

Commands go to the child through a sender thread (a full pipe never blocks the loop); anything they carry
must pickle, so `call(fn)` takes module-level functions only and the KV hand-off (which needs the engine's
blocks in this process) is not available: a worker with --engine-process runs role both, one model. The
child ends when this process closes its end of the command pipe (shutdown, exit or SIGKILL); when the child
dies, every open stream fails with EngineDeadError and no new request is taken.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from flotilla.engine.async_engine import _ABORTED, EngineDeadError, RequestStream, StreamOwner, _settle
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine_core import EngineFacts, Sender, run
from flotilla.engine.new_request import NewRequest
from flotilla.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a child that has not stopped by then is killed


class EngineView:
    """What callers read of the engine (AsyncEngine.engine's read-only attributes), without asking the child."""

    def __init__(self, config: EngineConfig, facts: EngineFacts):
        self.config = config
        self.model_version = facts.model_version
        self.max_model_len = facts.max_model_len
        self.dtype = facts.dtype
        self.tokenizer = Tokenizer.from_pretrained(config.model_dir)


class ProcessEngine(StreamOwner):
    def __init__(self, config: EngineConfig, check_integrity_when_idle: bool = True, stream_interval_s: float = 0.0):
        super().__init__()
        self._config = config
        self._check_integrity_when_idle = check_integrity_when_idle
        self._stream_interval_s = stream_interval_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._events = None  # our end of the child's event pipe
        self._sender: Sender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._view: EngineView | None = None
        self._failure: BaseException | None = None
        self._stopping = False
        self._stopped: asyncio.Future[None] | None = None
        self._tokens = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], RequestStream | None]] = {}  # token -> its waiter
        self._active: dict[str, RequestStream] = {}  # requests the child holds (its adds acknowledged)
        self._receiver: threading.Thread | None = None
        self.integrity_ok = True

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the child and return once its engine is loaded; raises what its start-up raised."""
        if self._process is not None:
            raise RuntimeError("ProcessEngine already started")
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        context = multiprocessing.get_context("spawn")  # never fork a process with gRPC threads
        commands_in, commands_out = context.Pipe(duplex=False)
        events_in, events_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run, name="flotilla-engine", daemon=True,
            args=(commands_in, events_out, self._config, self._stream_interval_s, self._check_integrity_when_idle))
        self._process.start()
        commands_in.close()  # the child's ends: with them closed here, either side sees EOF when the other goes
        events_out.close()
        self._events = events_in
        self._sender = Sender(commands_out)
        try:
            first = await asyncio.to_thread(events_in.recv)  # model loading takes seconds
            if first[0] == "failed":
                raise first[1]
            self._view = EngineView(self._config, first[1])
            self._on_message(await asyncio.to_thread(events_in.recv))  # the first snapshot
        except BaseException as exc:
            self._failure = exc if not isinstance(exc, EOFError) else EngineDeadError("engine process exited")
            await self._reap()
            _settle(self._stopped, None, None)  # a later shutdown() has nothing to wait for
            raise self._failure from None
        # A thread blocks on the pipe: the loop's add_reader would make the fd non-blocking (uvloop does),
        # which Connection.recv cannot read from. One wake-up of the loop per engine turn.
        self._receiver = threading.Thread(target=self._receive, name="flotilla-engine-events", daemon=True)
        self._receiver.start()

    async def shutdown(self) -> None:
        """Abort what is running, stop the child and wait for it; open streams end with ABORT."""
        if self._process is None or self._stopped is None:
            return
        if not self._stopping and self._failure is None:
            self._stopping = True
            self._sender.send(("stop",))
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped), STOP_TIMEOUT_S)
        except TimeoutError:
            logger.error("engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
        await self._reap()

    async def wait_exited(self) -> BaseException | None:
        """Returns once the child has exited: None after shutdown(), else why it died."""
        await asyncio.shield(self._stopped)
        return self._failure

    @property
    def engine(self) -> EngineView:
        if self._view is None:
            raise RuntimeError("ProcessEngine not started")
        return self._view

    @property
    def is_running(self) -> bool:
        return self._view is not None and self._failure is None and not self._stopping

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ---- requests ----------------------------------------------------------------------------------
    def _submit_add(self, new: NewRequest, stream: RequestStream) -> asyncio.Future[None]:
        return self._command("add", new, stream)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) in the child between steps; fn and its result must pickle (a module-level function)."""
        self._check_running()
        return await self._command("call", fn)

    async def generate_prefilled(self, prefilled: Any) -> RequestStream:
        raise EngineDeadError("a remotely prefilled request needs the engine in the worker's process")

    async def abort(self, request_id: str) -> bool:
        self._check_running()
        return await self._command("abort", request_id)

    def _check_running(self) -> None:
        if self._view is None:
            raise EngineDeadError("ProcessEngine not started")
        if self._failure is not None or self._stopping:
            raise EngineDeadError(f"engine stopped: {self._failure or 'shutdown'}")

    def _command(self, kind: str, payload: Any, stream: RequestStream | None = None) -> asyncio.Future[Any]:
        token = next(self._tokens)
        future = self._loop.create_future()
        self._pending[token] = (future, stream)
        self._sender.send((kind, payload, token))
        return future

    def _abort_soon(self, request_id: str) -> None:
        if self._failure is None and not self._stopping:
            self._sender.send(("abort", request_id, None))

    # ---- the child's messages (on the loop) --------------------------------------------------------
    def _receive(self) -> None:
        """The receiver thread: each message to the loop, then the child's exit."""
        try:
            while True:
                self._call_soon(self._on_message, self._events.recv())
        except (EOFError, OSError):
            self._call_soon(self._on_child_gone)

    def _call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _on_message(self, message: tuple) -> None:
        if message[0] == "stopped":
            return  # EOF follows
        events, self._snapshot, self.integrity_ok = message
        for event in events:
            kind = event[0]
            if kind == "outputs":
                for request_id, output in event[1]:
                    stream = self._active.get(request_id)
                    if stream is None:
                        continue
                    if output.finished:
                        del self._active[request_id]
                    stream._push(output)
            elif kind == "ack":
                _, token, result, exc = event
                future, stream = self._pending.pop(token)
                if stream is not None and exc is None:  # an add went through: its outputs follow
                    self._active[stream.request_id] = stream
                _settle(future, result, exc)
            elif kind == "aborted":
                _, request_id, token, found = event
                stream = self._active.pop(request_id, None)
                if stream is not None:
                    stream._push(_ABORTED)
                if token is not None:
                    _settle(self._pending.pop(token)[0], found, None)
            elif kind == "dead":
                self._fail(EngineDeadError(event[1]))

    def _on_child_gone(self) -> None:
        if not self._stopping and self._failure is None:
            self._process.join(1.0)
            logger.error("engine process exited (code %s); failing every open request", self._process.exitcode)
            self._fail(EngineDeadError(f"engine process exited with code {self._process.exitcode}"))
        self._fail(EngineDeadError("engine stopped"))  # whatever was still waiting
        _settle(self._stopped, None, None)

    def _fail(self, error: EngineDeadError) -> None:
        if self._failure is None and not self._stopping:
            self._failure = error
        streams, self._active = list(self._active.values()), {}
        for stream in streams:
            stream._push(error)
        pending, self._pending = list(self._pending.values()), {}
        for future, _ in pending:
            _settle(future, None, error)

    async def _reap(self) -> None:
        process = self._process
        await asyncio.to_thread(process.join, STOP_TIMEOUT_S if self._stopped.done() else 0.5)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join)
        if self._sender is not None:
            self._sender.close()
        if self._receiver is not None:
            await asyncio.to_thread(self._receiver.join)  # it ends at the child's EOF
        if self._events is not None:
            self._events.close()
