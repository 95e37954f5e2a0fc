"""Stream interval: how often a running request's tokens leave the engine thread.

With interval K > 1, a running request's new tokens are held and released every K engine steps, on the same
steps for every request: a worker then sends one message per K steps per hop instead of one per step, and
each SSE event carries about K tokens. Every message and event costs CPU in the worker, router, gateway and
client; on a host whose cores they share with the engine, that is throughput (vLLM's `--stream-interval`
is the same trade). A request's first output and its last leave at once, so TTFT and the end of a stream are
never delayed; in between a client sees bursts of K tokens. K = 1 (the default): every step, nothing held.

Engine thread only (no locking).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

from flotilla.engine.outputs import RequestOutput

S = TypeVar("S", bound=Hashable)  # the consumer's stream, as the engine thread knows it


class StreamPacer:
    def __init__(self, interval: int = 1):
        if interval < 1:
            raise ValueError(f"stream interval must be >= 1, got {interval}")
        self.interval = interval
        self._num_steps = 0
        self._held: dict[S, list[RequestOutput]] = {}

    def pace(self, deliveries: list[tuple[S, RequestOutput]]) -> list[tuple[S, RequestOutput]]:
        """One step's outputs in, what leaves now out (per stream in order: held outputs first)."""
        if self.interval == 1:
            return deliveries
        self._num_steps += 1
        if self._num_steps % self.interval == 0:
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
