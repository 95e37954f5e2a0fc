"""Inbox (engine/inbox.py), the direct-delivery rule of the worker's RequestStream and the router's SessionStream:
an item goes to the handler only while the consumer waits with nothing in hand; otherwise it is queued, in
order. Driven step by step on the test's loop, without timing."""

from __future__ import annotations

import asyncio
import logging

import pytest

from flotilla.engine.inbox import Inbox


async def _waiting(inbox: Inbox) -> asyncio.Task:
    """A consumer blocked in wait()."""
    task = asyncio.ensure_future(inbox.wait())
    await asyncio.sleep(0)  # let it reach its await
    assert not task.done()
    return task


async def test_an_item_goes_to_the_handler_only_while_the_consumer_waits_with_nothing_queued():
    inbox: Inbox[int] = Inbox("test")
    taken: list[int] = []
    inbox.deliver_directly(lambda item: taken.append(item) or True)
    assert not inbox.try_deliver_directly(1)  # the consumer is busy (holding an item): queued instead
    inbox.put(1)
    await inbox.wait()  # returns at once: 1 is queued
    assert inbox.items.popleft() == 1
    consumer = await _waiting(inbox)
    assert inbox.try_deliver_directly(2) and taken == [2]  # waiting, nothing queued: direct
    inbox.put(3)  # wakes the consumer; until it runs, 3 is still queued
    assert not inbox.try_deliver_directly(4)  # must not overtake 3
    inbox.put(4)
    await consumer
    assert list(inbox.items) == [3, 4] and taken == [2]


async def test_a_declining_handler_leaves_the_item_to_iteration():
    inbox: Inbox[int] = Inbox("test")
    inbox.deliver_directly(lambda item: False)
    consumer = await _waiting(inbox)
    assert not inbox.try_deliver_directly(1)
    inbox.put(1)
    await consumer
    assert list(inbox.items) == [1] and inbox.handler is not None


async def test_a_raising_handler_is_dropped_and_its_item_queued(caplog):
    inbox: Inbox[int] = Inbox("stream 7")
    inbox.deliver_directly(lambda item: 1 / 0)
    consumer = await _waiting(inbox)
    with caplog.at_level(logging.ERROR, logger="flotilla.engine.inbox"):
        assert not inbox.try_deliver_directly(1)
    assert "stream 7" in caplog.text and inbox.handler is None
    inbox.put(1)
    await consumer
    assert list(inbox.items) == [1]


async def test_a_cancelled_wait_leaves_the_items_and_takes_no_direct_delivery():
    inbox: Inbox[int] = Inbox("test")
    taken: list[int] = []
    inbox.deliver_directly(lambda item: taken.append(item) or True)
    consumer = await _waiting(inbox)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert not inbox.try_deliver_directly(1)  # nobody waits any more
    inbox.put(1)
    await inbox.wait()
    assert list(inbox.items) == [1] and taken == []
