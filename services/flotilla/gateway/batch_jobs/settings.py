"""Batch-job limits and knobs (GatewaySettings.batch; `flotilla gateway --batch-*`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BatchSettings:
    state_file: Path | None = None  # SQLite file when the gateway has no Redis; None: in memory (not durable)
    max_file_bytes: int = 64 * 1024 * 1024  # an uploaded JSONL file, or an Anthropic create body
    max_requests: int = 50_000  # items per job (OpenAI's and Anthropic's limit has the same order)
    max_line_bytes: int = 1024 * 1024  # one item
    concurrency_per_tenant: int = 4  # items of one tenant in flight at once, over all its jobs
    completion_window_s: float = 24 * 3600.0  # what "24h" means here (shorter in tests of expiry)
    lease_ttl_s: float = 10.0  # a gateway that dies holding a job frees it after this long
    retry_s: float = 0.5  # first wait before re-running an item refused as overloaded or rate-limited
    max_retry_s: float = 10.0
    # The batch rate per tier: what an item's tokens count against the tenant's token quota and in the ledger's
    # billable tokens, as a fraction of an interactive request's (OpenAI's batch discount is half).
    price_factor_paid: float = 0.5
    price_factor_free: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_requests", "max_line_bytes", "concurrency_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch {name} must be >= 1, got {getattr(self, name)}")
        for name in ("completion_window_s", "lease_ttl_s", "retry_s", "max_retry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"batch {name} must be > 0, got {getattr(self, name)}")
        for name in ("price_factor_paid", "price_factor_free"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"batch {name} must be a number >= 0, got {getattr(self, name)}")

    def price_factor(self, tier: str) -> float:
        return self.price_factor_free if tier == "free" else self.price_factor_paid
