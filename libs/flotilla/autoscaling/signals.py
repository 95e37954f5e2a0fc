"""What the control law reads about one pool, as measured by the router (GetPoolSignals)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolSignals:
    num_active: int  # in rotation: the router places work there
    num_warm: int  # registered, weights loaded, out of rotation
    num_draining: int = 0  # no new work; finishing what they hold
    num_queued_requests: int = 0  # waiting in the router's queue for this model
    num_queued_tokens: int = 0  # known but not yet computed tokens: router queue + active workers' queues
    num_used_blocks: int = 0  # KV blocks in use on active workers
    num_total_blocks: int = 0  # KV blocks of active workers
    ttft_p95_s: float = 0.0  # over the router's recent window; 0 when no request finished its first token
    num_prompt_tokens: int = 0  # admitted in the window: the prompt side of the token mix
    num_output_tokens: int = 0  # relayed in the window: the output side of the token mix
    seconds_since_last_request: float = 0.0  # since the router placed one for the model (0: just now)

    def __post_init__(self) -> None:
        for name in ("num_active", "num_warm", "num_draining", "num_queued_requests", "num_queued_tokens",
                     "num_used_blocks", "num_total_blocks", "num_prompt_tokens", "num_output_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.num_used_blocks > self.num_total_blocks:
            raise ValueError("num_used_blocks must be <= num_total_blocks")
        if self.ttft_p95_s < 0 or self.seconds_since_last_request < 0:
            raise ValueError("ttft_p95_s and seconds_since_last_request must be >= 0")

    @property
    def kv_utilisation(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def num_blocks_per_replica(self) -> float:
        return self.num_total_blocks / self.num_active if self.num_active else 0.0


@dataclass(frozen=True)
class TokenMix:
    """Measured prompt and output tokens over the same window (rates or counts: only the ratio matters)."""

    num_prompt_tokens: float
    num_output_tokens: float

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0 or self.num_output_tokens < 0:
            raise ValueError("token counts must be >= 0")
