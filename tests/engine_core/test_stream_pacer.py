"""StreamPacer (engine/stream_pacer.py): with interval K a running request's tokens leave every K steps, the
same steps for all requests; first and last outputs leave at once; an abort drops what was held."""

from __future__ import annotations

import pytest

from flotilla.engine.outputs import RequestOutput
from flotilla.engine.request import FinishReason
from flotilla.engine.stream_pacer import StreamPacer


def _output(request_id: str, index: int, finished: bool = False) -> RequestOutput:
    """Token `index` (0-based) of a request, alone in its output."""
    return RequestOutput(request_id, [index], f"t{index} ", finished, FinishReason.LENGTH if finished else None,
                         None, 5, 0, index + 1)


def _run(pacer: StreamPacer, plans: dict[str, tuple[int, int]], num_steps: int) -> list[list[tuple[str, int]]]:
    """plans: request -> (first step, number of tokens); returns what left at each step as (request, token)."""
    left = []
    for step in range(num_steps):
        deliveries = []
        for request_id, (start, num_tokens) in plans.items():
            index = step - start
            if 0 <= index < num_tokens:
                deliveries.append((request_id, _output(request_id, index, finished=index == num_tokens - 1)))
        left.append([(stream, output.new_token_ids[0]) for stream, output in pacer.pace(deliveries)])
    return left


def test_interval_one_passes_every_step_through():
    pacer = StreamPacer(1)
    assert _run(pacer, {"a": (0, 3)}, 3) == [[("a", 0)], [("a", 1)], [("a", 2)]]


def test_running_tokens_leave_every_k_steps_on_the_same_steps_for_all():
    left = _run(StreamPacer(3), {"a": (0, 8), "b": (1, 4)}, 9)
    assert left[0] == [("a", 0)]  # a's first token at once
    assert left[1] == [("b", 0)]  # b's first token at once, a's second held
    assert left[2] == [("a", 1), ("a", 2), ("b", 1)]  # step 3 of the pacer: everything held, in order
    assert left[3] == []
    assert left[4] == [("b", 2), ("b", 3)]  # b's last token: at once, with what it held before
    assert left[5] == [("a", 3), ("a", 4), ("a", 5)]
    assert left[6] == [] and left[7] == [("a", 6), ("a", 7)]  # a's last token flushes its held one
    assert sorted(t for step in left for s, t in step if s == "a") == list(range(8))


def test_an_aborted_request_loses_what_it_held():
    pacer = StreamPacer(4)
    pacer.pace([("a", _output("a", 0))])
    assert pacer.pace([("a", _output("a", 1))]) == []
    pacer.drop("a")
    assert pacer.pace([]) == [] and pacer.pace([]) == []  # step 4: nothing of a's left to release


def test_the_interval_is_at_least_one():
    with pytest.raises(ValueError):
        StreamPacer(0)
