"""Wait on a condition with a deadline (never a fixed sleep): the one poll loop of the suite, plain and async.

    wait_until(lambda: worker_load().num_running == 0, 10, "the worker to go idle")
    value = wait_until(find_it, 30, "a prefill worker")  # the predicate's truthy value is returned
    await async_wait_until(gate.check, 10, "Redis to answer", interval_s=0.05)  # a coroutine function too

At the deadline an AssertionError says "timed out after <timeout_s> s waiting for <what>"; `what` may be a
callable, called then, to name the last state seen. Exceptions of the types in `ignore` count as "not yet".
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.01

What = str | Callable[[], str]


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0, what: What = "condition",
               interval_s: float = POLL_S, ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Call `predicate` every `interval_s` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout_s, what))
        time.sleep(interval_s)


async def async_wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0, what: What = "condition",
                           interval_s: float = POLL_S, ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """wait_until inside an event loop: sleeps with asyncio, and awaits what `predicate` returns if awaitable."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(timeout_s, what))
        await asyncio.sleep(interval_s)


def _timed_out(timeout_s: float, what: What) -> str:
    return f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}"
