"""Pure pieces: prefix affinity with a load cap (router placement) and per-transfer arrival counting."""

from __future__ import annotations

import asyncio

import pytest

from flotilla.kv_transfer.arrivals import ArrivalTracker, notif_message
from flotilla.router.placement import AffinityLimits, Candidate, WorkerLoad, choose_decode_worker, choose_prefill_worker


def _candidate(worker_id: str, num_requests: int, num_cached_blocks: int, queued: int = 0, free: int = 100):
    return Candidate(WorkerLoad(worker_id, queued, num_requests, free, 100), num_cached_blocks)


def test_decode_prefers_longest_prefix_within_the_load_cap():
    limits = AffinityLimits(max_decode_load_margin=4)
    holder, idle = _candidate("a", 4, 10), _candidate("b", 0, 0)
    assert choose_decode_worker([holder, idle], limits).load.worker_id == "a"  # 4 <= 0 + 4
    busier = _candidate("a", 5, 10)
    assert choose_decode_worker([busier, idle], limits).load.worker_id == "b"  # over the cap: spread


def test_decode_without_prefix_takes_fewest_requests_then_most_free_kv():
    limits = AffinityLimits()
    picked = choose_decode_worker([_candidate("a", 2, 0), _candidate("b", 1, 0, free=10), _candidate("c", 1, 0)], limits)
    assert picked.load.worker_id == "c"


def test_prefill_cap_counts_queued_tokens():
    limits = AffinityLimits(max_prefill_token_margin=1000)
    holder, idle = _candidate("p1", 0, 8, queued=1500), _candidate("p2", 0, 0, queued=0)
    assert choose_prefill_worker([holder, idle], limits).load.worker_id == "p2"
    assert choose_prefill_worker([_candidate("p1", 0, 8, queued=900), idle], limits).load.worker_id == "p1"
    assert choose_prefill_worker([], limits) is None


def test_arrivals_complete_when_all_writes_landed_even_before_waiting():
    tracker = ArrivalTracker()
    tracker.open("t1", [4, 5])

    async def scenario():
        tracker.on_notif("peer", notif_message("t1", 0, [4, 5]))  # lands before anyone waits
        waiter = tracker.expect("t1", 3)
        for layer in (1, 2):
            assert not waiter.done()
            tracker.on_notif("peer", notif_message("t1", layer, [4, 5]))
        await asyncio.wait_for(waiter, 5)
        assert tracker.check("t1", "peer") is None

    asyncio.run(scenario())


def test_late_notification_of_a_forgotten_transfer_is_dropped():
    tracker = ArrivalTracker()
    tracker.open("t2", [1])
    tracker.on_notif("peer", notif_message("t2", 0, [1]))
    tracker.forget("t2")
    tracker.on_notif("peer", notif_message("t2", 1, [1]))
    assert tracker.num_arrived("t2") == 0 and tracker.num_refused == 1


def test_affinity_limits_reject_bad_values():
    with pytest.raises(ValueError):
        AffinityLimits(min_remote_prefill_tokens=0)
