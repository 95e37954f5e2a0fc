"""hold_batch: batch-class sequences sit out the steps in which an interactive request waits for or is in its
prefill (paused, blocks kept), resume once none is pending, never for interactive decodes alone, and at most
hold_batch_max_steps steps in a row; an interactive request short of blocks or a seat preempts batch ones first.
(Greedy exactness under holding: test_exactness.py.)"""

from __future__ import annotations

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.request import Priority, RequestStatus
from flotilla.engine.scheduler import SchedulerConfig

from tests.engine.test_scheduler import _chunks, _request, _scheduler, _step


def _names(output) -> list[str]:
    return [c[0] for c in _chunks(output)]


def _decoding_batch(scheduler, runner, names=("b1", "b2"), max_tokens=30):
    for i, name in enumerate(names):
        scheduler.add_request(_request(name, [1 + i, 2], max_tokens=max_tokens, priority=Priority.BATCH))
    ran = _names(_step(scheduler, runner))
    assert all(name in ran for name in names)  # their prefill; from here on they decode


def test_batch_waits_out_an_interactive_prefill_and_resumes_after():
    scheduler, runner = _scheduler(num_blocks=64, max_num_batched_tokens=64)
    _decoding_batch(scheduler, runner)
    b1_blocks = scheduler.kv.block_ids("b1")
    scheduler.add_request(_request("i1", range(10, 20), max_tokens=5))
    held = _step(scheduler, runner)
    assert _chunks(held) == [("i1", 0, 10)]  # the prefill alone, the whole budget open to it
    assert scheduler.kv.block_ids("b1") == b1_blocks and scheduler.requests["b1"].status is RequestStatus.RUNNING
    assert not held.preempted and scheduler.num_held_steps == 1
    # i1 decodes now: batch runs beside it again, from where it stopped.
    assert _chunks(_step(scheduler, runner)) == [("b1", 2, 1), ("b2", 2, 1), ("i1", 10, 1)]
    assert scheduler.num_held_steps == 1


def test_a_chunked_interactive_prefill_holds_batch_for_every_chunk_and_decodes_alone_never_do():
    scheduler, runner = _scheduler(num_blocks=64, max_num_batched_tokens=8)
    scheduler.add_request(_request("i0", [9], max_tokens=30))
    _step(scheduler, runner)  # i0 decodes from here on: an interactive decode never holds batch
    _decoding_batch(scheduler, runner)
    assert _names(_step(scheduler, runner)) == ["i0", "b1", "b2"]
    scheduler.add_request(_request("i1", range(100, 120), max_tokens=5))  # 20 tokens: 3 chunks under 8 a step
    ran = [_names(_step(scheduler, runner)) for _ in range(4)]
    assert ran == [["i0", "i1"], ["i0", "i1"], ["i0", "i1"], ["i0", "b1", "b2", "i1"]]


def test_batch_waiting_is_not_admitted_beside_an_interactive_prefill():
    scheduler, runner = _scheduler(num_blocks=64, max_num_batched_tokens=64)
    scheduler.add_request(_request("i1", [1, 2, 3], max_tokens=5))
    scheduler.add_request(_request("b1", [4, 5], max_tokens=5, priority=Priority.BATCH))
    assert _names(_step(scheduler, runner)) == ["i1"]
    assert _names(_step(scheduler, runner)) == ["i1", "b1"]


def test_a_flood_of_interactive_prefills_holds_batch_at_most_max_steps_in_a_row():
    scheduler, runner = _scheduler(num_blocks=256, max_num_batched_tokens=64, hold_batch_max_steps=3)
    _decoding_batch(scheduler, runner, names=("b1",), max_tokens=100)
    batch_ran = []
    for i in range(12):  # a new interactive prompt every step: a prefill is always pending
        scheduler.add_request(_request(f"i{i}", [7, i], max_tokens=1))
        batch_ran.append("b1" in _names(_step(scheduler, runner)))
    assert batch_ran == [False, False, False, True] * 3
    assert scheduler.num_held_steps == 9


def test_without_hold_batch_runs_beside_interactive_prefills():
    scheduler, runner = _scheduler(num_blocks=64, max_num_batched_tokens=64, hold_batch=False)
    _decoding_batch(scheduler, runner)
    scheduler.add_request(_request("i1", range(10, 20), max_tokens=5))
    assert _names(_step(scheduler, runner)) == ["b1", "b2", "i1"] and scheduler.num_held_steps == 0


def test_an_interactive_request_short_of_blocks_preempts_the_newest_batch_sequence():
    scheduler, runner = _scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64, num_lookahead_steps=0)
    _decoding_batch(scheduler, runner, names=("b1", "b2", "b3"), max_tokens=4)  # a block each...
    _step(scheduler, runner)  # ...and a second each: 6 of 6 taken
    assert scheduler.kv.num_free_blocks == 0
    scheduler.add_request(_request("i1", range(10, 13), max_tokens=2))  # 3 tokens: 2 blocks
    output = _step(scheduler, runner)
    assert [r.request_id for r in output.preempted] == ["b3"]  # the newest batch sequence, and only it
    assert _chunks(output) == [("i1", 0, 3)]
    assert scheduler.requests["b3"].status is RequestStatus.PREEMPTED and scheduler.kv.block_ids("b1")


def test_an_interactive_request_takes_a_batch_sequence_s_seat_at_max_num_seqs():
    scheduler, runner = _scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    _decoding_batch(scheduler, runner)
    scheduler.add_request(_request("i1", [5, 6], max_tokens=2))
    output = _step(scheduler, runner)
    assert [r.request_id for r in output.preempted] == ["b2"] and _names(output) == ["i1"]
    assert scheduler.num_running == 2


def test_a_cap_below_one_step_is_refused():
    with pytest.raises(ValueError, match="hold_batch_max_steps"):
        SchedulerConfig(hold_batch_max_steps=0)
    with pytest.raises(ValueError, match="hold_batch_max_steps"):
        EngineConfig(model_dir="unused", hold_batch_max_steps=0).validate()
