"""Degradation before refusal, as policy: who is degraded, how much, from which load; and the load signal's
staleness (no answer from the router for a while reads as no load, never as the last heavy one)."""

from __future__ import annotations

import pytest

from flotilla.api.router.v1 import router_pb2
from flotilla.gateway.degradation import DegradationPolicy, plan, pressure
from flotilla.gateway.queue_load import QueueLoad
from flotilla.tenancy.admission_policy import AdmissionPolicy
from flotilla.tenancy.records import Limits

POLICY = DegradationPolicy(onset_s=1.0, free_max_tokens=64, min_free_quota_fraction=0.25)
BUDGETS = AdmissionPolicy(interactive_free_s=5.0)
LIMITS = Limits(tokens_per_minute=10_000)


def test_pressure_rises_linearly_from_the_onset_to_the_free_budget():
    assert [pressure(w, 1.0, 5.0) for w in (0.0, 0.99, 1.0, 3.0, 5.0, 50.0)] == [0.0, 0.0, 0.0, 0.5, 1.0, 1.0]
    assert pressure(2.0, 3.0, 3.0) == 0.0 and pressure(3.0, 3.0, 3.0) == 1.0  # onset at the budget: a step


def test_free_requests_are_capped_and_their_quota_tightens_with_the_load():
    light = plan(POLICY, BUDGETS, "free", 1.0, 10, 256, LIMITS)
    assert light.max_tokens == 64 and light.limits == LIMITS  # at the onset: capped, quota still whole
    assert light.header_value == "max_tokens=64"
    half = plan(POLICY, BUDGETS, "free", 3.0, 10, 256, LIMITS)
    assert half.limits.tokens_per_minute == 6250  # 1 - 0.75 x 0.5
    assert half.header_value == "max_tokens=64; tokens_per_minute=6250"
    full = plan(POLICY, BUDGETS, "free", 9.0, 10, 256, LIMITS)
    assert full.limits.tokens_per_minute == 2500 and full.pressure == 1.0
    tpms = [plan(POLICY, BUDGETS, "free", w, 10, 256, LIMITS).limits.tokens_per_minute for w in (1, 2, 3, 4, 5)]
    assert tpms == sorted(tpms, reverse=True) and len(set(tpms)) == 5  # dynamic, not one static bucket


def test_nothing_is_degraded_below_the_onset_for_paid_without_a_signal_or_when_off():
    assert plan(POLICY, BUDGETS, "free", 0.9, 10, 256, LIMITS) is None
    assert plan(POLICY, BUDGETS, "paid", 30.0, 10, 256, LIMITS) is None
    assert plan(POLICY, BUDGETS, "free", None, 10, 256, LIMITS) is None  # throughput unmeasured, or stale
    assert plan(DegradationPolicy(enabled=False), BUDGETS, "free", 30.0, 10, 256, LIMITS) is None


def test_a_small_request_of_an_unlimited_tenant_keeps_what_it_asked_for():
    assert plan(POLICY, BUDGETS, "free", 3.0, 10, 32, Limits()) is None  # under the cap, no token limit
    only_quota = plan(POLICY, BUDGETS, "free", 3.0, 10, 32, LIMITS)
    assert only_quota.max_tokens == 32 and only_quota.header_value == "tokens_per_minute=6250"


def test_a_tightened_quota_never_turns_a_request_into_one_too_large_for_it():
    tiny_quota = Limits(tokens_per_minute=200)  # x 0.25 = 50, less than the request
    degraded = plan(POLICY, BUDGETS, "free", 9.0, 50, 256, tiny_quota)
    assert degraded.limits.tokens_per_minute == 50 + 64  # the request itself still fits: 429 later, not 400


@pytest.mark.parametrize("field, value", [("onset_s", -1.0), ("free_max_tokens", 0),
                                          ("min_free_quota_fraction", 0.0), ("min_free_quota_fraction", 1.5),
                                          ("poll_interval_s", 0.0)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ValueError):
        DegradationPolicy(**{field: value})


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_the_load_signal_polls_wanted_models_and_goes_stale():
    clock, asked = Clock(), []

    async def fetch(models):
        asked.append(list(models))
        response = router_pb2.GetQueueLoadResponse()
        response.models.add(model="m", interactive_wait_s=2.5, num_queued_requests=7)
        response.models.add(model="cold")  # throughput unmeasured: no estimate
        return response

    load = QueueLoad(fetch, interval_s=0.5, clock=clock)
    await load.poll_once()
    assert asked == []  # nobody asked for a model yet: no call
    assert load.wait_s("m") is None and load.wait_s("cold") is None
    await load.poll_once()
    assert asked == [["cold", "m"]] and load.wait_s("m") == 2.5 and load.wait_s("cold") is None
    clock.now += 2.0  # == 4 intervals: still fresh
    assert load.wait_s("m") == 2.5
    clock.now += 0.1
    assert load.wait_s("m") is None  # the router stopped answering: no signal, nothing degraded
    clock.now += 61.0
    load.wait_s("m")
    await load.poll_once()  # "m" was asked for just now, "cold" not for a minute
    assert asked[-1] == ["m"]
