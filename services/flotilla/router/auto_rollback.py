"""The automatic rollback rule (optional, `flotilla router --auto-rollback-*`): a rollout whose candidate's error
rate or TTFT p95 is beyond its bound over the last window (N minutes, with enough requests to judge) is rolled
back, as `flotilla models rollback` would: new requests go to the current version, in-flight ones finish."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flotilla.router.model_routes import ModelRoutes, RouteChangeError
from flotilla.router.models import ModelVersionRef
from flotilla.router.version_stats import Summary, VersionStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoRollbackRule:
    max_error_rate: float | None = None  # errors / requests, 0..1
    max_ttft_p95_s: float | None = None
    window_s: float = 120.0
    min_requests: int = 20  # fewer in the window: not judged yet

    def __post_init__(self) -> None:
        if self.max_error_rate is not None and not 0.0 <= self.max_error_rate <= 1.0:
            raise ValueError("the automatic rollback's error rate bound must be within 0..1")
        if (self.max_ttft_p95_s is not None and self.max_ttft_p95_s <= 0) or self.window_s <= 0:
            raise ValueError("the automatic rollback's TTFT bound and window must be > 0")
        if self.min_requests < 1:
            raise ValueError("the automatic rollback's min_requests must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.max_error_rate is not None or self.max_ttft_p95_s is not None

    def breach(self, summary: Summary) -> str | None:
        """Why the candidate fails the rule, or None."""
        if summary.num_requests < self.min_requests:
            return None
        if self.max_error_rate is not None and summary.error_rate > self.max_error_rate:
            return (f"error rate {100 * summary.error_rate:.1f}% > {100 * self.max_error_rate:g}% over "
                    f"{summary.num_requests} requests in {self.window_s:g} s")
        if self.max_ttft_p95_s is not None and summary.ttft_s[1] > self.max_ttft_p95_s:
            return (f"TTFT p95 {summary.ttft_s[1]:.3f} s > {self.max_ttft_p95_s:g} s over "
                    f"{summary.num_requests} requests in {self.window_s:g} s")
        return None


def check_rollouts(rule: AutoRollbackRule, routes: ModelRoutes, stats: VersionStats,
                   versions: Callable[[], Sequence[ModelVersionRef]]) -> list[str]:
    """Roll back every rollout whose candidate breaches the rule; the names rolled back."""
    rolled_back = []
    for name, route in list(routes.routes.items()):
        if not route.candidate:
            continue
        why = rule.breach(stats.summary(name, route.candidate, rule.window_s))
        if why is None:
            continue
        try:
            routes.rollback(name, versions(), reason=f"automatic: {why}")
        except RouteChangeError as err:  # changed meanwhile
            logger.warning("automatic rollback of %s refused: %s", name, err.message)
            continue
        rolled_back.append(name)
    return rolled_back
