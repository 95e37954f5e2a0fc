"""Settings of the golden-output health check (output_check.py), importable without the engine (CLI flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSettings:
    interval_s: float = 10.0  # between checks while idle; 0 turns the check off
    busy_interval_s: float = 60.0  # between checks while requests run
    # None: by the serving dtype (Tolerances.for_dtype). Batching moves float32 logprobs by ~1e-5 and 16-bit
    # ones by up to ~1e-1, so both bounds sit far above what a healthy device does.
    logprob_tolerance: float | None = None  # nats a compared token's logprob may move
    min_margin: float | None = None  # nats of top-1 over top-2 at load for a token to be compared


@dataclass(frozen=True)
class Tolerances:
    logprob_tolerance: float
    min_margin: float

    @classmethod
    def for_dtype(cls, dtype_name: str, settings: CheckSettings) -> Tolerances:
        wide = dtype_name != "float32"
        default = cls(0.15, 0.5) if wide else cls(0.01, 0.01)
        return cls(default.logprob_tolerance if settings.logprob_tolerance is None else settings.logprob_tolerance,
                   default.min_margin if settings.min_margin is None else settings.min_margin)
