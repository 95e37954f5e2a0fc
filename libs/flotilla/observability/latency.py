"""The latencies users feel, by model and tier: TTFT, TPOT, inter-token and end-to-end histograms, and the
per-request timer that feeds them. The gateway and the worker each own one set, under their own prefix."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from prometheus_client import CollectorRegistry, Histogram

from flotilla.observability.buckets import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS

LABELS = ("model", "tier")


@dataclass
class LatencyHistograms:
    ttft: Histogram
    tpot: Histogram
    itl: Histogram
    e2e: Histogram

    @classmethod
    def create(cls, prefix: str, registry: CollectorRegistry, ttft: Histogram | None = None) -> LatencyHistograms:
        """`ttft`: an existing TTFT histogram to reuse (the gateway defined its own before this module)."""
        return cls(
            ttft=ttft or Histogram(f"{prefix}_ttft_seconds", "Time from arrival to the first generated token",
                                   LABELS, buckets=LATENCY_BUCKETS, registry=registry),
            tpot=Histogram(f"{prefix}_tpot_seconds", "Mean time per output token after the first, per request",
                           LABELS, buckets=TOKEN_LATENCY_BUCKETS, registry=registry),
            itl=Histogram(f"{prefix}_itl_seconds", "Inter-token latency: gap between streamed token messages, "
                          "per token", LABELS, buckets=TOKEN_LATENCY_BUCKETS, registry=registry),
            e2e=Histogram(f"{prefix}_e2e_seconds", "Time from arrival to the last token", LABELS,
                          buckets=LATENCY_BUCKETS, registry=registry),
        )


@dataclass
class StreamTimer:
    """Times one streamed request; `clock` is injectable for tests. Several tokens in one message share the
    gap since the previous message (each of them is observed as gap / n), as a client sees them."""

    histograms: LatencyHistograms
    model: str
    tier: str
    started_at: float
    clock: Callable[[], float] = time.perf_counter
    num_output_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = field(default=None)

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = self.clock()
        if self.first_token_at is None:
            self.first_token_at = now
            self._labelled(self.histograms.ttft).observe(now - self.started_at)
        else:
            gap = (now - self.last_token_at) / num_tokens
            itl = self._itl
            for _ in range(num_tokens):
                itl.observe(gap)
        self.last_token_at = now
        self.num_output_tokens += num_tokens

    def finish(self) -> None:
        """Once, when the stream ends (also on errors: e2e is observed only if a token came)."""
        if self.finished_at is not None:
            return
        self.finished_at = self.clock()
        if self.first_token_at is None:
            return
        self._labelled(self.histograms.e2e).observe(self.finished_at - self.started_at)
        if self.num_output_tokens > 1:
            tpot = (self.last_token_at - self.first_token_at) / (self.num_output_tokens - 1)
            self._labelled(self.histograms.tpot).observe(tpot)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    @property
    def e2e_s(self) -> float | None:
        end = self.finished_at if self.finished_at is not None else self.last_token_at
        return None if end is None else end - self.started_at

    @cached_property
    def _itl(self):
        return self._labelled(self.histograms.itl)  # once per request, not per token

    def _labelled(self, histogram: Histogram):
        return histogram.labels(self.model, self.tier)
