"""TrafficWindow keeps token counts per second: a burst of relayed chunks is one entry, counts stay exact,
and the window's start and the 300 s horizon are honoured to the second."""

from __future__ import annotations

from flotilla.router.traffic import MAX_WINDOW_S, TrafficWindow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_chunks_in_one_second_are_one_entry_and_counts_are_exact():
    clock = Clock()
    traffic = TrafficWindow(clock)
    for i in range(5000):  # 5,000 relayed chunks within one second
        clock.now = 1000.0 + i / 5001
        traffic.record_output("m", 2)
    traffic.record_prompt("m", 7)
    assert len(traffic._models["m"].output_tokens) == 1
    assert traffic.snapshot("m", 30.0).num_output_tokens == 10_000
    assert traffic.snapshot("m", 30.0).num_prompt_tokens == 7


def test_the_window_and_the_horizon_cut_by_whole_seconds():
    clock = Clock()
    traffic = TrafficWindow(clock)
    traffic.record_output("m", 1)  # second 1000
    clock.now = 1010.5
    traffic.record_output("m", 10)  # second 1010
    clock.now = 1030.2
    assert traffic.snapshot("m", 20.0).num_output_tokens == 10  # window from 1010.2: second 1010 counts
    assert traffic.snapshot("m", 31.0).num_output_tokens == 11
    clock.now = 1000.0 + MAX_WINDOW_S + 1.0
    assert traffic.snapshot("m", MAX_WINDOW_S).num_output_tokens == 10  # second 1000 fell off the horizon
