"""A pool's scaling policy: bounds, targets, cooldowns. Mirrors the FlotillaPool spec (operator) and the
`flotilla up --autoscale` flags (local supervisor)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolPolicy:
    min_replicas: int = 1  # active replicas, never fewer
    max_replicas: int = 4  # active replicas, never more (warm ones come on top)
    warm_replicas: int = 0  # kept loaded and out of rotation; promoted first on scale-up
    target_queued_tokens_per_replica: int = 2048
    target_kv_utilisation: float = 0.8  # scale so that used KV / total KV stays under this
    ttft_p95_slo_s: float = 2.0  # p95 time to first token the pool must meet
    ttft_settle_s: float = 30.0  # after a scale-up, TTFT misses are ignored this long (the p95 window lags)
    scale_up_cooldown_s: float = 0.0  # between two scale-ups: fast up
    scale_down_cooldown_s: float = 300.0  # after any change, before a scale-down: slow down
    hysteresis: float = 0.2  # scale down only when the load fits fewer replicas at (1 - hysteresis) of target
    max_scale_down_step: int = 1  # replicas drained per scale-down decision
    # min_replicas 0 only: the last replica leaves once no request came for this long (its streams finish on
    # it while it drains); 0: as soon as the load fits no replica at all.
    scale_to_zero_idle_s: float = 0.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < 1 or self.min_replicas > self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.warm_replicas < 0:
            raise ValueError("warm_replicas must be >= 0")
        if self.target_queued_tokens_per_replica < 1:
            raise ValueError("target_queued_tokens_per_replica must be >= 1")
        if not 0 < self.target_kv_utilisation <= 1:
            raise ValueError("target_kv_utilisation must be in (0, 1]")
        if self.ttft_p95_slo_s <= 0:
            raise ValueError("ttft_p95_slo_s must be > 0")
        if self.ttft_settle_s < 0:
            raise ValueError("ttft_settle_s must be >= 0")
        if self.scale_up_cooldown_s < 0 or self.scale_down_cooldown_s < 0:
            raise ValueError("cooldowns must be >= 0")
        if not 0 <= self.hysteresis < 1:
            raise ValueError("hysteresis must be in [0, 1)")
        if self.max_scale_down_step < 1:
            raise ValueError("max_scale_down_step must be >= 1")
        if self.scale_to_zero_idle_s < 0:
            raise ValueError("scale_to_zero_idle_s must be >= 0")


@dataclass(frozen=True)
class RoleThroughput:
    """Measured tokens per second one replica sustains in each role (loadtest figures)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError("throughputs must be > 0")
