"""The automatic rollback rule: a candidate beyond its error-rate or TTFT bound (with enough requests) is
rolled back; a healthy one, or one with too few requests, is left alone."""

from __future__ import annotations

import pytest

from flotilla.router.auto_rollback import AutoRollbackRule, check_rollouts
from flotilla.router.model_routes import ModelRoutes
from flotilla.router.models import ModelVersionRef
from flotilla.router.version_stats import VersionStats

V1 = ModelVersionRef("tiny", "v1", 1.0, True)
V2 = ModelVersionRef("tiny", "v2", 2.0, True)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def rollout() -> ModelRoutes:
    routes = ModelRoutes()
    routes.observe([V1])
    routes.set_rollout("tiny", "v2", 10, [V1, V2])
    return routes


def finish(stats: VersionStats, version: str, outcomes: list[str], ttft_s: float = 0.05) -> None:
    for outcome in outcomes:
        stats.started("tiny", version)
        stats.finished("tiny", version, outcome, ttft_s, 0.01, 8)


def test_error_rate_beyond_the_bound_rolls_back():
    routes, stats = rollout(), VersionStats(Clock())
    rule = AutoRollbackRule(max_error_rate=0.05, min_requests=20)
    finish(stats, "v2", ["ok"] * 10)
    finish(stats, "v2", ["internal"] * 2)
    assert check_rollouts(rule, routes, stats, lambda: [V1, V2]) == []  # 12 requests: not judged yet
    finish(stats, "v2", ["ok"] * 8)
    finish(stats, "v1", ["internal"] * 50)  # the current version's errors are not the candidate's
    assert check_rollouts(rule, routes, stats, lambda: [V1, V2]) == ["tiny"]
    assert not routes.routes["tiny"].candidate
    assert "automatic: error rate 10.0% > 5%" in routes.changes[-1].detail


def test_ttft_bound_and_a_healthy_candidate():
    routes, stats = rollout(), VersionStats(Clock())
    rule = AutoRollbackRule(max_ttft_p95_s=0.5, min_requests=5)
    finish(stats, "v2", ["ok", "cancelled"] * 5, ttft_s=0.1)
    assert check_rollouts(rule, routes, stats, lambda: [V1, V2]) == []
    finish(stats, "v2", ["ok"] * 10, ttft_s=2.0)
    assert check_rollouts(rule, routes, stats, lambda: [V1, V2]) == ["tiny"]


def test_samples_outside_the_window_do_not_count():
    clock = Clock()
    routes, stats = rollout(), VersionStats(clock)
    rule = AutoRollbackRule(max_error_rate=0.0, window_s=60, min_requests=1)
    finish(stats, "v2", ["internal"])
    clock.now += 61
    assert check_rollouts(rule, routes, stats, lambda: [V1, V2]) == []


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        AutoRollbackRule(max_error_rate=5)
    assert not AutoRollbackRule().enabled
