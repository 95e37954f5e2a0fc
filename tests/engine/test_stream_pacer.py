"""StreamPacer (engine/stream_pacer.py): with an interval of D seconds, running requests' tokens leave at the
first step D or more after the previous release, the same step for all requests; first and last outputs leave
at once; an abort drops what was held; steps slower than D hold nothing."""

from __future__ import annotations

import pytest

from flotilla.engine.outputs import RequestOutput
from flotilla.engine.request import FinishReason
from flotilla.engine.stream_pacer import StreamPacer


def _output(request_id: str, index: int, finished: bool = False) -> RequestOutput:
    """Token `index` (0-based) of a request, alone in its output."""
    return RequestOutput(request_id, [index], f"t{index} ", finished, FinishReason.LENGTH if finished else None,
                         None, 5, 0, index + 1)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(interval_s: float, step_s: float, plans: dict[str, tuple[int, int]],
         num_steps: int) -> list[list[tuple[str, int]]]:
    """plans: request -> (first step, number of tokens); returns what left at each step as (request, token)."""
    clock = _Clock()
    pacer = StreamPacer(interval_s, clock)
    left = []
    for step in range(num_steps):
        clock.now += step_s
        deliveries = []
        for request_id, (start, num_tokens) in plans.items():
            index = step - start
            if 0 <= index < num_tokens:
                deliveries.append((request_id, _output(request_id, index, finished=index == num_tokens - 1)))
        left.append([(stream, output.new_token_ids[0]) for stream, output in pacer.pace(deliveries)])
    return left


def test_no_interval_passes_every_step_through():
    assert _run(0.0, 0.01, {"a": (0, 3)}, 3) == [[("a", 0)], [("a", 1)], [("a", 2)]]


def test_running_tokens_leave_together_once_the_interval_has_passed():
    # 10 ms steps, 25 ms interval: releases at steps 0 (the first), 3 and 6, for every request alike.
    left = _run(0.025, 0.010, {"a": (0, 9), "b": (1, 4)}, 9)
    assert left[0] == [("a", 0)]
    assert left[1] == [("b", 0)]  # b's first token at once; a's second held
    assert left[2] == []
    assert left[3] == [("a", 1), ("a", 2), ("b", 1), ("a", 3), ("b", 2)]  # what was held, then this step
    assert left[4] == [("b", 3)]  # b's last token: at once
    assert left[5] == [] and left[6] == [("a", 4), ("a", 5), ("a", 6)]
    assert left[8] == [("a", 7), ("a", 8)]  # a's last token flushes what it held
    assert sorted(t for step in left for s, t in step if s == "a") == list(range(9))


def test_steps_slower_than_the_interval_hold_nothing():
    assert _run(0.025, 0.030, {"a": (0, 4)}, 4) == [[("a", 0)], [("a", 1)], [("a", 2)], [("a", 3)]]


def test_an_aborted_request_loses_what_it_held():
    clock = _Clock()
    pacer = StreamPacer(1.0, clock)
    assert pacer.pace([("a", _output("a", 0))]) == [("a", _output("a", 0))]
    clock.now += 0.1
    assert pacer.pace([("a", _output("a", 1))]) == []
    pacer.drop("a")
    clock.now += 1.0
    assert pacer.pace([]) == []  # the release finds nothing of a's


def test_the_interval_is_not_negative():
    with pytest.raises(ValueError):
        StreamPacer(-0.1)
