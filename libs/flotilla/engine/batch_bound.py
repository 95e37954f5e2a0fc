"""Batch size bounded by a target inter-token latency: AIMD on the number of sequences a step runs.

Each step advances every sequence it runs by one token, so a step's wall time is the inter-token latency
(TPOT) of every sequence in it, and it grows with their number. The controller smooths measured step times
(EWMA) and moves a cap on sequences per step: over the target, the cap drops to a fraction of what just ran
(multiplicative decrease, then a few steps' cool-down so that the average sees the smaller batch); under
`headroom` x target while the cap is what limits the step, it grows by one (additive increase). The
scheduler fills the cap interactive first (scheduler.py), so batch-class sequences are the first to wait.

Step times come from the engine loop (engine.py), never from a clock here: the logic is testable with fake
step times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchBoundConfig:
    target_step_s: float  # the interactive TPOT to stay under
    min_seqs: int = 8  # never fewer per step: a noisy machine slows the fleet, it does not stall it
    decrease: float = 0.8  # over the target: cap = this x the sequences that ran
    headroom: float = 0.85  # grow only while the smoothed step time is under this x target
    alpha: float = 0.3  # EWMA weight of the newest step
    cooldown_steps: int = 4  # steps after a decrease before the next one

    def __post_init__(self) -> None:
        if not self.target_step_s > 0:
            raise ValueError(f"target_step_s must be > 0, got {self.target_step_s}")
        if self.min_seqs < 1:
            raise ValueError(f"min_seqs must be >= 1, got {self.min_seqs}")
        for name in ("decrease", "headroom", "alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.cooldown_steps < 0:
            raise ValueError(f"cooldown_steps must be >= 0, got {self.cooldown_steps}")


class BatchBound:
    """The cap on sequences per step; `observe()` after every step that ran something."""

    def __init__(self, config: BatchBoundConfig, max_seqs: int):
        self.config = config
        self.max_seqs = max_seqs
        self.cap = max_seqs
        self.smoothed_step_s = 0.0
        self._cooldown = 0
        self.num_decreases = 0

    def observe(self, step_s: float, num_seqs: int) -> int:
        """One step's wall time and the sequences it ran; returns the new cap."""
        config = self.config
        if num_seqs <= 0:
            return self.cap
        self.smoothed_step_s = step_s if self.smoothed_step_s == 0 else (
            config.alpha * step_s + (1 - config.alpha) * self.smoothed_step_s)
        if self._cooldown:
            self._cooldown -= 1
            return self.cap
        if self.smoothed_step_s > config.target_step_s:
            ran = min(self.cap, num_seqs)
            self.cap = max(min(config.min_seqs, self.max_seqs), math.floor(ran * config.decrease))
            self._cooldown = config.cooldown_steps
            self.num_decreases += 1
        elif self.smoothed_step_s < config.headroom * config.target_step_s and num_seqs >= self.cap:
            self.cap = min(self.max_seqs, self.cap + 1)
        return self.cap
