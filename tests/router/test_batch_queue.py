"""Pending calls of a fixed-batch model (router/batch_queue.py): paid before free in every flush, the
size-or-time rule, deadlines dropped before dispatch, cancelled calls skipped."""

from __future__ import annotations

from flotilla.router.batch_queue import PendingCall, TierQueues


def call(call_id: int, tier: str = "free", arrived_s: float = 0.0, deadline_s: float = float("inf")) -> PendingCall:
    return PendingCall(call_id, f"in-{call_id}", tier, arrived_s, lambda result: None, deadline_s=deadline_s)


def test_a_flush_takes_paid_calls_first_even_when_free_ones_arrived_before():
    queues = TierQueues()
    for i in range(40):
        queues.add(call(i, "free", arrived_s=i * 0.001))
    for i in range(40, 70):
        queues.add(call(i, "paid", arrived_s=1.0 + i * 0.001))
    first = queues.take(50, now_s=2.0).calls
    assert [c.call_id for c in first] == list(range(40, 70)) + list(range(20))  # 30 paid, then the oldest free
    second = queues.take(50, now_s=2.0).calls
    assert [c.call_id for c in second] == list(range(20, 40))
    assert len(queues) == 0


def test_an_unknown_tier_ranks_after_paid_and_free():
    queues = TierQueues()
    queues.add(call(1, "trial"))
    queues.add(call(2, "free"))
    queues.add(call(3, "paid"))
    assert [c.call_id for c in queues.take(3, 0.0).calls] == [3, 2, 1]


def test_due_at_batch_size_or_once_the_oldest_waited_the_flush_wait():
    queues = TierQueues()
    queues.add(call(1, arrived_s=10.0))
    assert not queues.is_due(10.125, max_batch_size=3, max_wait_s=0.25)
    assert queues.next_due_s(0.25) == 10.25
    assert queues.is_due(10.25, max_batch_size=3, max_wait_s=0.25)  # time
    queues.add(call(2, arrived_s=10.01))
    queues.add(call(3, arrived_s=10.02))
    assert queues.is_due(10.02, max_batch_size=3, max_wait_s=0.25)  # size


def test_calls_past_their_deadline_are_dropped_not_taken():
    queues = TierQueues()
    queues.add(call(1, "paid", deadline_s=5.0))
    queues.add(call(2, "paid", deadline_s=50.0))
    queues.add(call(3, "free", deadline_s=4.0))
    taken = queues.take(10, now_s=6.0)
    assert [c.call_id for c in taken.calls] == [2]
    assert [c.call_id for c in taken.expired] == [1, 3]


def test_expire_removes_expired_and_given_up_calls_anywhere_in_the_queue():
    queues = TierQueues()
    queues.add(call(1, deadline_s=100.0))
    queues.add(call(2, deadline_s=1.0))
    given_up = call(3)
    given_up.give_up_s = 2.0
    queues.add(given_up)
    assert [c.call_id for c in queues.expire(now_s=3.0)] == [2, 3]
    assert len(queues) == 1 and [c.call_id for c in queues.take(5, 3.0).calls] == [1]


def test_a_cancelled_call_no_longer_counts_and_is_skipped():
    queues = TierQueues()
    first, second = call(1, arrived_s=1.0), call(2, arrived_s=2.0)
    queues.add(first)
    queues.add(second)
    queues.cancel(first)
    assert len(queues) == 1
    assert queues.oldest_arrival_s() == 2.0
    assert [c.call_id for c in queues.take(5, 3.0).calls] == [2]
