"""The batch bound's feedback logic on fake step times (AIMD on sequences per step), and the scheduler under
it: at most `cap` sequences a step, interactive first, batch-class sequences the first to wait (paused,
their blocks kept) and the first to give way to a waiting interactive request."""

from __future__ import annotations

import pytest

from flotilla.engine.batch_bound import BatchBound, BatchBoundConfig
from flotilla.engine.config import resolve_target_tpot_s
from flotilla.engine.request import Priority

from tests.engine.test_scheduler import _chunks, _request, _scheduler, _step

TARGET = 0.040


def step_time(num_seqs: int) -> float:
    """A fake engine: 10 ms plus 1 ms per sequence (the target is met at 30 sequences)."""
    return 0.010 + 0.001 * num_seqs


def run(bound: BatchBound, offered: int, steps: int) -> list[int]:
    """`offered` sequences always ready; each step runs min(cap, offered). The caps after each step."""
    caps = []
    for _ in range(steps):
        ran = min(bound.cap, offered)
        caps.append(bound.observe(step_time(ran), ran))
    return caps


def test_the_cap_falls_under_overload_and_settles_at_the_target():
    bound = BatchBound(BatchBoundConfig(TARGET, min_seqs=2, cooldown_steps=2), max_seqs=256)
    caps = run(bound, offered=200, steps=300)
    assert caps[0] < 200 and bound.num_decreases >= 1  # 210 ms steps: cut at once
    settled = caps[-100:]
    assert max(step_time(c) for c in settled) <= TARGET * 1.05  # steps at or just under the target, AIMD's sawtooth
    assert min(settled) >= 0.8 * 0.85 * 30 - 1  # ...and not far below it: no collapse to the floor


def test_the_cap_grows_back_when_steps_get_faster_but_only_while_it_binds():
    bound = BatchBound(BatchBoundConfig(TARGET, min_seqs=2, cooldown_steps=0, alpha=1.0), max_seqs=64)
    bound.observe(0.100, 64)
    assert bound.cap == 51  # 0.8 x 64
    bound.observe(0.001, 10)
    assert bound.cap == 51  # fast, but only 10 ran: the cap did not limit anything, so it does not grow
    for _ in range(20):
        bound.observe(0.001, bound.cap)
    assert bound.cap == 64  # additive increase up to max_num_seqs, never past it
    assert bound.observe(0.001, 64) == 64


def test_the_cap_never_goes_below_its_floor_and_a_cool_down_spaces_decreases():
    bound = BatchBound(BatchBoundConfig(TARGET, min_seqs=8, cooldown_steps=3, alpha=1.0), max_seqs=256)
    caps = [bound.observe(1.0, bound.cap) for _ in range(100)]  # hopelessly slow steps
    assert min(caps) == 8 and caps[-1] == 8
    assert caps[:8] == [204, 204, 204, 204, 163, 163, 163, 163]  # one cut, three steps of cool-down, the next
    assert BatchBound(BatchBoundConfig(TARGET, min_seqs=8), max_seqs=4).observe(1.0, 4) == 4  # floor <= max


def test_idle_steps_teach_nothing():
    bound = BatchBound(BatchBoundConfig(TARGET), max_seqs=32)
    assert bound.observe(5.0, 0) == 32 and bound.smoothed_step_s == 0.0


@pytest.mark.parametrize("field, value", [("target_step_s", 0.0), ("min_seqs", 0), ("decrease", 0.0),
                                          ("headroom", 1.5), ("alpha", 0.0), ("cooldown_steps", -1)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ValueError):
        BatchBoundConfig(**{"target_step_s": TARGET, field: value})


def test_target_flag_values():
    assert resolve_target_tpot_s("auto", "cpu") == 0.040
    assert resolve_target_tpot_s("25", "cpu") == 0.025
    assert resolve_target_tpot_s("off", "cpu") is None and resolve_target_tpot_s("0", "cpu") is None
    for bad in ("fast", "-5", "nan"):
        with pytest.raises(ValueError):
            resolve_target_tpot_s(bad, "cpu")


def bounded_scheduler(cap: int, **config):
    scheduler, runner = _scheduler(num_blocks=64, max_num_batched_tokens=64,
                                   batch_bound=BatchBoundConfig(TARGET, min_seqs=1), **config)
    scheduler.bound.cap = cap  # as if the controller had settled there
    return scheduler, runner


def test_batch_sequences_wait_first_when_the_cap_binds():
    scheduler, runner = bounded_scheduler(cap=4, hold_batch=False)  # the bound alone (test_batch_hold.py: hold)
    for name in ("b1", "b2", "b3"):
        scheduler.add_request(_request(name, [1, 2], max_tokens=20, priority=Priority.BATCH))
    assert [c[0] for c in _chunks(_step(scheduler, runner))] == ["b1", "b2", "b3"]  # under the cap: all run
    for name in ("i1", "i2"):
        scheduler.add_request(_request(name, [3, 4], max_tokens=20))
    # Two interactive arrivals: admitted at once, and a batch sequence gives up its slot (paused, not preempted).
    ran = [c[0] for c in _chunks(_step(scheduler, runner))]
    assert sorted(ran) == ["b1", "b2", "i1", "i2"]
    assert scheduler.num_running == 5 and scheduler.kv.block_ids("b3")  # b3 keeps its blocks
    assert [c[0] for c in _chunks(_step(scheduler, runner))] == ["i1", "i2", "b1", "b2"]  # interactive first
    scheduler.add_request(_request("i3", [5, 6], max_tokens=20))
    scheduler.add_request(_request("i4", [7, 8], max_tokens=20))
    ran = [c[0] for c in _chunks(_step(scheduler, runner))]
    assert ran == ["i1", "i2", "i3", "i4"]  # every batch sequence waits while interactive fills the cap


def test_without_a_bound_every_running_sequence_runs():
    scheduler, runner = _scheduler(num_blocks=64, max_num_batched_tokens=64, hold_batch=False)
    for i in range(6):
        scheduler.add_request(_request(f"r{i}", [i + 1], max_tokens=20, priority=Priority(i % 2)))
    assert len(_chunks(_step(scheduler, runner))) == 6 and scheduler.seq_limit == 256
