"""A simulated accelerator: every call takes exactly L, whatever the batch size, and each output is a
deterministic transform of its own input (tests check for cross-talk with `transform`; capacity planning
uses the fixed L)."""

from __future__ import annotations

import hashlib
import time

from flotilla.worker.fixed_batch.contract import BatchOptions, ContractError

SPIN_S = 0.0005  # the last half millisecond is spun, so a call ends within tens of microseconds of L


def transform(text: str) -> str:
    """The simulated model: the input reversed, tagged with a digest of it (one output per input, never equal
    for two different inputs in practice)."""
    return f"{text[::-1]}#{hashlib.blake2b(text.encode(), digest_size=4).hexdigest()}"


class SimulatedAccelerator:
    def __init__(self, max_batch_size: int = 50, latency_s: float = 0.2):
        self.max_batch_size = max_batch_size
        self.latency_s = latency_s
        self.num_calls = 0

    @classmethod
    def from_options(cls, options: BatchOptions) -> SimulatedAccelerator:
        return cls(options.max_batch_size, options.batch_latency_ms / 1000)

    def __call__(self, inputs: list[str]) -> list[str]:
        if not 1 <= len(inputs) <= self.max_batch_size:
            raise ContractError(f"a batch takes 1 to {self.max_batch_size} inputs, got {len(inputs)}")
        end = time.perf_counter() + self.latency_s
        outputs = [transform(text) for text in inputs]
        remaining = end - time.perf_counter()
        if remaining > SPIN_S:
            time.sleep(remaining - SPIN_S)
        while time.perf_counter() < end:
            pass
        self.num_calls += 1
        return outputs
