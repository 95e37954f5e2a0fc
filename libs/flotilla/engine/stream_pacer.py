"""Stream interval: how often running requests' tokens leave the engine thread.

With an interval of D seconds, a running request's new tokens are held and released at the first engine step
that ends D or more after the previous release, the same step for every request: a worker then sends one
message per release per hop instead of one per step, and each SSE event carries the tokens of several steps.
Every message and event costs CPU in the worker, router, gateway and client; on a host whose cores they share
with the engine that is throughput. D is time, not a step count, so it bounds what a client waits for a token
whatever the model's step time (with steps slower than D nothing is held). A request's first output and its
last leave at once: TTFT and the end of a stream are never delayed. D = 0 (the default): nothing is held.

Engine thread only (no locking).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

from flotilla.engine.outputs import RequestOutput

S = TypeVar("S", bound=Hashable)  # the consumer's stream, as the engine thread knows it


class StreamPacer:
    def __init__(self, interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        if interval_s < 0:
            raise ValueError(f"stream interval must be >= 0 s, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._last_release = float("-inf")
        self._held: dict[S, list[RequestOutput]] = {}

    def pace(self, deliveries: list[tuple[S, RequestOutput]]) -> list[tuple[S, RequestOutput]]:
        """One step's outputs in, what leaves now out (per stream in order: held outputs first)."""
        if not self.interval_s:
            return deliveries
        now = self._clock()
        if now - self._last_release >= self.interval_s:
            self._last_release = now
            released = [(stream, output) for stream, held in self._held.items() for output in held]
            self._held.clear()
            return released + deliveries
        leaving = []
        for stream, output in deliveries:
            if output.finished or output.num_output_tokens <= len(output.new_token_ids):  # last, or first
                leaving.extend((stream, held) for held in self._held.pop(stream, ()))
                leaving.append((stream, output))
            else:
                self._held.setdefault(stream, []).append(output)
        return leaving

    def drop(self, stream: S) -> None:
        """The request was aborted: what it still held goes nowhere."""
        self._held.pop(stream, None)

    def clear(self) -> None:
        self._held.clear()
