"""One system's timed run, and the ratio of two of them."""

from __future__ import annotations

from typing import NamedTuple


class Throughput(NamedTuple):
    system: str
    num_output_tokens: int  # requested tokens only: padding and overshoot in a static batch do not count
    seconds: float
    num_requests_timed: int
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds > 0 else float("inf")


def wave_seconds_note(wave_seconds: list[float]) -> str:
    """"; waves 2.31, 2.40 s" for a note when a system ran more than one wave, else ""."""
    if len(wave_seconds) < 2:
        return ""
    return "; waves " + ", ".join(f"{seconds:.2f}" for seconds in wave_seconds) + " s"


def ratio(numerator: Throughput | None, denominator: Throughput | None) -> float | None:
    if numerator is None or denominator is None or denominator.tok_s == 0:
        return None
    return numerator.tok_s / denominator.tok_s
