"""Degradation before refusal: while the router's queue grows, free-tier interactive requests get less before any
is refused (batch-class ones wait or are shed instead: a batch job's output must be what it asked for).

The signal is the router's interactive backlog as a wait: every tenant's queued interactive tokens / measured
throughput (router/queue_load.py; queue_load.py here polls it), an upper bound of the estimate the router
sheds a single request on, so degradation always comes first. From `onset_s` on, a free-tier request's `max_tokens` is capped at `free_max_tokens` and its tenant's
tokens-per-minute limit is tightened in proportion to the load: the pressure rises linearly from 0 at
`onset_s` to 1 at the free tier's wait budget (AdmissionPolicy.interactive_free_s), where the router starts
shedding free requests, and the limit falls with it from 100% to `min_free_quota_fraction`. The ladder as the
wait grows: free requests degraded, then batch shed (its budget), then free shed, then paid (the router's
wait budgets, unchanged). Paid requests are never degraded.

The client is told: the response carries `x-flotilla-degraded` (what was applied, e.g. `max_tokens=64;
tokens_per_minute=3000`), a capped generation ends with finish_reason `length` (Anthropic: stop_reason
`max_tokens`) at the cap, which its usage shows, and the rate-limit headers carry the tightened limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from flotilla.tenancy.admission_policy import AdmissionPolicy
from flotilla.tenancy.records import Limits

DEGRADED_HEADER = "x-flotilla-degraded"


@dataclass(frozen=True)
class DegradationPolicy:
    enabled: bool = True
    onset_s: float = 1.0  # estimated interactive queue wait from which free requests are degraded
    free_max_tokens: int = 64  # a degraded free request's max_tokens at most
    min_free_quota_fraction: float = 0.25  # free token quotas at full pressure (the free wait budget)
    poll_interval_s: float = 0.5  # how often the gateway reads the router's queue load

    def __post_init__(self) -> None:
        if self.onset_s < 0 or self.poll_interval_s <= 0:
            raise ValueError("degradation onset_s must be >= 0 and poll_interval_s > 0")
        if self.free_max_tokens < 1:
            raise ValueError(f"free_max_tokens must be >= 1, got {self.free_max_tokens}")
        if not 0 < self.min_free_quota_fraction <= 1:
            raise ValueError(f"min_free_quota_fraction must be in (0, 1], got {self.min_free_quota_fraction}")


@dataclass(frozen=True)
class Degradation:
    """What a degraded request gets instead of what it asked for."""

    max_tokens: int
    limits: Limits
    pressure: float  # 0 at the onset, 1 at the free wait budget
    applied: tuple[str, ...]  # "name=value" of each change made, for the header

    @property
    def header_value(self) -> str:
        return "; ".join(self.applied)


def pressure(wait_s: float, onset_s: float, full_s: float) -> float:
    """0 at the onset, rising linearly to 1 at `full_s` (and beyond)."""
    if wait_s < onset_s:
        return 0.0
    if full_s <= onset_s:
        return 1.0
    return min(1.0, (wait_s - onset_s) / (full_s - onset_s))


def plan(policy: DegradationPolicy, admission: AdmissionPolicy, tier: str, wait_s: float | None,
         num_prompt_tokens: int, max_tokens: int, limits: Limits) -> Degradation | None:
    """The degradation of one request; None when it gets what it asked for (paid, no signal, below the onset,
    or nothing to change)."""
    if not policy.enabled or tier != "free" or wait_s is None or wait_s < policy.onset_s:
        return None
    level = pressure(wait_s, policy.onset_s, admission.interactive_free_s)
    applied = []
    capped = min(max_tokens, policy.free_max_tokens)
    if capped < max_tokens:
        applied.append(f"max_tokens={capped}")
    tightened = limits
    if limits.tokens_per_minute:
        fraction = 1.0 - (1.0 - policy.min_free_quota_fraction) * level
        # Never below this one request: tightening throttles (429), it must not turn a request into a 400.
        tpm = max(math.ceil(limits.tokens_per_minute * fraction), num_prompt_tokens + capped)
        if tpm < limits.tokens_per_minute:
            tightened = replace(limits, tokens_per_minute=tpm)
            applied.append(f"tokens_per_minute={tpm}")
    if not applied:
        return None
    return Degradation(capped, tightened, level, tuple(applied))
