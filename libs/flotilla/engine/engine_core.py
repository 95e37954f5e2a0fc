"""The engine's own process (process_engine.py's child): the step loop with no event loop beside it.

In a worker the engine thread and the gRPC event loop take turns on one GIL; with the engine here the
worker's loop can run on other cores while every step of this process goes to the model. The loop is the
engine thread's of async_engine.py: apply the commands that arrived (add, abort, call), step while there is
work, otherwise sleep on the command pipe. Each turn's events (acks, outputs, aborts) leave in one message
with the load snapshot taken after them; a sender thread writes it, so that a parent that is slow to read
never stops a step. The parent's end of the command pipe closing (it exited, even by SIGKILL) ends this
process.

Messages in: ("add", NewRequest, token), ("abort", request_id, token or None), ("call", fn, token),
("stop",). Out: ("started", EngineFacts) or ("failed", error) once, then (events, EngineSnapshot, integrity_ok)
per turn, where an event is ("ack", token, result, error), ("outputs", [(request_id, RequestOutput)]),
("aborted", request_id, token, found) or ("dead", message); ("stopped",) last.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from flotilla.engine.async_engine import EngineSnapshot
from flotilla.engine.config import EngineConfig

logger = logging.getLogger(__name__)


class EngineFacts(NamedTuple):
    """What the parent reads of the engine without asking it (AsyncEngine.engine's read-only attributes)."""

    model_version: str
    max_model_len: int
    dtype: str  # e.g. "torch.float32"


class Sender:
    """Writes messages on its own thread, in order: the caller (the step loop, or the parent's event loop) only
    queues them, and never waits on a full pipe."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="flotilla-engine-sender", daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._connection.send(message)
            except (BrokenPipeError, OSError):  # the parent is gone: nothing to tell
                return


def run(commands: Connection, events: Connection, config: EngineConfig, stream_interval_s: float,
        check_integrity_when_idle: bool) -> None:
    """The child's entry point (multiprocessing, spawn)."""
    from flotilla.engine.engine import LLMEngine

    sender = Sender(events)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # start()'s caller raises it
        sender.send(("failed", _picklable(exc)))
        sender.close()
        return
    sender.send(("started", EngineFacts(engine.model_version, engine.max_model_len, str(engine.dtype))))
    try:
        _Core(engine, commands, sender, stream_interval_s, check_integrity_when_idle).serve()
    finally:
        sender.send(("stopped",))
        sender.close()


class _Core:
    def __init__(self, engine, commands: Connection, sender: Sender, stream_interval_s: float,
                 check_integrity_when_idle: bool):
        from flotilla.engine.stream_pacer import StreamPacer

        self._engine = engine
        self._commands = commands
        self._sender = sender
        self._pacer = StreamPacer(stream_interval_s)
        self._check_integrity_when_idle = check_integrity_when_idle
        self._active: set[str] = set()
        self._integrity_ok = True
        self._send([])  # the first snapshot, before any request

    def serve(self) -> None:
        engine = self._engine
        needs_check = False
        try:
            while True:
                commands, stopping = self._next_commands()
                engine.release_expired_quarantine()
                events = [self._apply(command) for command in commands]
                if stopping:
                    events.extend(self._abort_all())
                    self._send(events)
                    return
                if engine.has_unfinished_requests():
                    deliveries = self._pacer.pace(self._step())
                    if deliveries:
                        events.append(("outputs", deliveries))
                    needs_check = True
                if needs_check and not engine.has_unfinished_requests():
                    needs_check = False
                    if self._check_integrity_when_idle:
                        self._integrity_ok = engine.check_integrity()
                if events:
                    self._send(events)
        except BaseException as exc:
            logger.exception("engine process failed; failing every open request")
            self._active.clear()
            self._send([("dead", f"engine failed: {exc!r}")])

    def _next_commands(self) -> tuple[list[tuple], bool]:
        """Every command waiting; sleeps on the pipe while the engine has nothing to do. EOF: stop."""
        engine = self._engine
        timeout: float | None = 0.0
        if not engine.has_unfinished_requests():
            release_at = engine.next_quarantine_release()  # an idle engine wakes to end a quarantine
            timeout = None if release_at is None else max(0.0, release_at - time.monotonic())
        commands: list[tuple] = []
        try:
            if not self._commands.poll(timeout):
                return commands, False
            while True:
                commands.append(self._commands.recv())
                if commands[-1][0] == "stop":
                    return commands[:-1], True
                if not self._commands.poll(0):
                    return commands, False
        except (EOFError, OSError):  # the parent went away
            return commands, True

    def _apply(self, command: tuple) -> tuple:
        kind = command[0]
        if kind == "abort":
            _, request_id, token = command
            found = self._engine.abort(request_id)
            if request_id in self._active:
                self._active.discard(request_id)
                self._pacer.drop(request_id)
                return ("aborted", request_id, token, found)
            return ("ack", token, found, None)
        if kind == "call":
            _, fn, token = command
            try:
                return ("ack", token, fn(self._engine), None)
            except Exception as exc:  # back to the caller, not the process
                return ("ack", token, None, _picklable(exc))
        _, new, token = command  # "add"
        try:
            self._engine.add_request(new)
        except Exception as exc:  # validation errors (and bugs) go back to the caller
            return ("ack", token, None, _picklable(exc))
        self._active.add(new.request_id)
        return ("ack", token, None, None)

    def _step(self) -> list[tuple[str, Any]]:
        deliveries = []
        for output in self._engine.step():
            if output.request_id not in self._active:
                continue
            if output.finished:
                self._active.discard(output.request_id)
            deliveries.append((output.request_id, output))
        return deliveries

    def _abort_all(self) -> list[tuple]:
        events = []
        for request_id in list(self._active):
            self._engine.abort(request_id)
            events.append(("aborted", request_id, None, True))
        self._active.clear()
        self._pacer.clear()
        return events

    def _send(self, events: list[tuple]) -> None:
        snapshot = EngineSnapshot(self._engine.stats(), tuple(self._active))
        self._sender.send((events, snapshot, self._integrity_ok))


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling (the engine's errors do), else a RuntimeError naming it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
