"""One consumer task's items in arrival order, and direct delivery: the one rule that the worker's RequestStream
(engine outputs) and the router's SessionStream (a worker session's responses) share.

A relay's consumer task mostly waits for the next item only to hand it on. With a direct handler set, an item
that arrives while that task waits with nothing in hand goes to the handler at once, from whoever delivers it
(the engine's callback, the session's reader), instead of waking the task: no task switch per token. Only
then: an item the task already took but has not handed on yet must reach the handler's destination first,
and one queued before it must be read first. The handler returns False for an item it leaves to iteration
(queued then, in order); a raising handler is logged and dropped, and its item queued.

Single-threaded (the event loop); not a general queue: one consumer, no bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Inbox(Generic[T]):
    __slots__ = ("items", "handler", "_waiter", "_owner")

    def __init__(self, owner: object):
        """`owner`: names the stream in the log line of a failing handler."""
        self.items: deque[T] = deque()
        self.handler: Callable[[T], bool] | None = None  # read-only here: set it with deliver_directly()
        self._waiter: asyncio.Future[None] | None = None  # set while the consumer waits in wait()
        self._owner = owner

    def deliver_directly(self, handler: Callable[[T], bool] | None) -> None:
        """Set (or with None, clear) the direct handler."""
        self.handler = handler

    def try_deliver_directly(self, item: T) -> bool:
        """True when the handler took `item`: a handler is set, the consumer waits in wait(), nothing is queued.
        False: the caller queues it with put(). (Check `handler is not None` first where making `item` costs.)"""
        handler = self.handler
        if handler is None or self._waiter is None or self.items:
            return False
        try:
            return handler(item)
        except Exception:  # a handler bug must not lose the item or break whoever delivers it
            logger.exception("direct handler of %s failed; back to iteration", self._owner)
            self.handler = None
            return False

    def put(self, item: T) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until an item is queued (at once if one is). Cancelling it leaves the items as they were."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
