"""The control law, pure: fabricated signals, exact decisions."""

from __future__ import annotations

import math

import pytest

from flotilla.autoscaling.control import ScalerState, decide, demand, prefill_decode_ratio, prefill_replicas_for
from flotilla.autoscaling.policy import PoolPolicy, RoleThroughput
from flotilla.autoscaling.signals import PoolSignals, TokenMix

POLICY = PoolPolicy(
    min_replicas=1, max_replicas=8, warm_replicas=2, target_queued_tokens_per_replica=1000,
    target_kv_utilisation=0.8, ttft_p95_slo_s=1.0, ttft_settle_s=10.0,
    scale_up_cooldown_s=0.0, scale_down_cooldown_s=60.0, hysteresis=0.2, max_scale_down_step=1,
)


def signals(active: int, warm: int = 2, tokens: int = 0, used: int = 0, per_replica_blocks: int = 100,
            ttft: float = 0.0) -> PoolSignals:
    return PoolSignals(num_active=active, num_warm=warm, num_queued_tokens=tokens, num_used_blocks=used,
                       num_total_blocks=active * per_replica_blocks, ttft_p95_s=ttft)


def test_burst_promotes_warm_first_then_cold_starts_the_rest_and_refills():
    # 3x burst on 2 replicas: 6000 queued tokens need 6 replicas; 2 warm are promoted, 2 more + 2 refill start
    decision = decide(POLICY, signals(2, tokens=6000), ScalerState(), now_s=100.0)
    assert (decision.num_active, decision.num_promote, decision.num_start) == (6, 2, 4)
    assert decision.num_drain == decision.num_demote == 0
    assert decision.state.last_scale_up_s == 100.0
    assert "queued tokens 6000" in decision.reason


def test_started_replicas_are_not_started_twice_while_they_load():
    first = decide(POLICY, signals(2, tokens=6000), ScalerState(), now_s=100.0)
    # Next tick: promotion applied (4 active, warm pool empty), 4 replicas still loading.
    second = decide(POLICY, signals(4, warm=0, tokens=6000), first.state, now_s=101.0, num_starting=4)
    assert (second.num_active, second.num_promote, second.num_start) == (6, 0, 0)
    # They register warm: the next decision promotes two and restarts nothing.
    third = decide(POLICY, signals(4, warm=4, tokens=6000), second.state, now_s=102.0)
    assert (third.num_active, third.num_promote, third.num_start) == (6, 2, 0)


def test_sustained_overload_stops_at_max_replicas():
    state = ScalerState()
    active, warm = 2, 2
    for tick in range(10):
        decision = decide(POLICY, signals(active, warm=warm, tokens=50_000), state, now_s=float(tick))
        state = decision.state
        active += decision.num_promote
        warm = warm - decision.num_promote + decision.num_start  # started ones register warm by next tick
    assert active == POLICY.max_replicas == 8
    assert warm == POLICY.warm_replicas
    final = decide(POLICY, signals(active, warm=warm, tokens=50_000), state, now_s=20.0)
    assert not final.changed and final.num_active == 8


def test_kv_pressure_scales_up_without_queued_tokens():
    # 2 replicas x 100 blocks, 190 used: 190 / (100 * 0.8) -> 3 replicas
    decision = decide(POLICY, signals(2, used=190), ScalerState(), now_s=0.0)
    assert decision.num_active == 3 and "KV utilisation" in decision.reason


def test_ttft_miss_scales_up_then_is_ignored_while_it_settles():
    decision = decide(POLICY, signals(3, ttft=1.5), ScalerState(), now_s=0.0)
    assert decision.num_active == 5  # ceil(3 * 1.5)
    # Right after the scale-up the window still holds the slow requests: no second doubling.
    again = decide(POLICY, signals(5, warm=0, ttft=1.5), decision.state, now_s=5.0, num_starting=2)
    assert again.num_active == 5 and again.num_promote == 0
    later = decide(POLICY, signals(5, warm=2, ttft=3.0), decision.state, now_s=20.0)
    assert later.num_active == 8  # min(max_replicas, ceil(5 * 2.0))


def test_oscillation_guard_load_between_thresholds_holds():
    # 1900 tokens fits 2 replicas at the target but 3 at (1 - 0.2) of it (1900 / 800): hysteresis holds 3;
    # without it the pool would flap 3 -> 2 -> 3 as the load swings 2500 <-> 1900.
    state = ScalerState()
    up = decide(POLICY, signals(2, tokens=2500), state, now_s=0.0)
    assert up.num_active == 3
    active = 3
    for tick, tokens in enumerate([2500, 1900, 2500, 1900, 1700] * 4):
        decision = decide(POLICY, signals(active, tokens=tokens), up.state, now_s=100.0 + tick * 30)
        assert not decision.changed, decision.reason
    # A load that fits 2 replicas even at 80% of the target scales down (after the cooldown).
    down = decide(POLICY, signals(3, tokens=1500), up.state, now_s=1000.0)
    assert (down.num_active, down.num_drain) == (2, 1)


def test_cooldown_delays_scale_down_and_steps_by_one():
    up = decide(POLICY, signals(2, tokens=6000), ScalerState(), now_s=0.0)
    idle = signals(6, tokens=0)
    assert not decide(POLICY, idle, up.state, now_s=59.0).changed
    first = decide(POLICY, idle, up.state, now_s=60.0)
    assert (first.num_active, first.num_drain) == (5, 1)
    assert not decide(POLICY, signals(5, tokens=0), first.state, now_s=119.0).changed
    second = decide(POLICY, signals(5, tokens=0), first.state, now_s=120.0)
    assert second.num_active == 4


def test_scale_up_cooldown():
    policy = PoolPolicy(**{**POLICY.__dict__, "scale_up_cooldown_s": 5.0})
    up = decide(policy, signals(2, tokens=3000), ScalerState(), now_s=0.0)
    held = decide(policy, signals(3, warm=1, tokens=6000), up.state, now_s=4.0)
    assert held.num_promote == 0 and "cooling down" in held.reason
    assert decide(policy, signals(3, warm=1, tokens=6000), up.state, now_s=5.0).num_active == 6


def test_min_and_max_bounds():
    assert decide(POLICY, signals(1, tokens=0), ScalerState(), now_s=1e6).num_active == 1  # never below min
    assert decide(POLICY, signals(0, warm=2), ScalerState(last_scale_up_s=0.0), now_s=0.0).num_active == 1
    assert decide(POLICY, signals(2, tokens=10**9), ScalerState(), now_s=0.0).num_active == 8


def test_scale_down_refills_the_warm_pool_by_demotion_before_draining():
    decision = decide(POLICY, signals(4, warm=1, tokens=0), ScalerState(), now_s=1000.0)
    assert (decision.num_active, decision.num_demote, decision.num_drain) == (3, 1, 0)
    full = decide(POLICY, signals(4, warm=2, tokens=0), ScalerState(), now_s=1000.0)
    assert (full.num_demote, full.num_drain) == (0, 1)


def test_warm_pool_refill_and_retire_in_steady_state():
    refill = decide(POLICY, signals(2, warm=0, tokens=1500), ScalerState(), now_s=0.0)
    assert (refill.num_promote, refill.num_start, refill.num_active) == (0, 2, 2)
    assert decide(POLICY, signals(2, warm=0, tokens=1500), ScalerState(), 0.0, num_starting=2).num_start == 0
    surplus = decide(POLICY, signals(2, warm=4, tokens=1500), ScalerState(), now_s=0.0)
    assert surplus.num_retire_warm == 2


def test_no_scale_down_while_a_drain_is_unfinished():
    draining = PoolSignals(num_active=4, num_warm=2, num_draining=1, num_total_blocks=400)
    held = decide(POLICY, draining, ScalerState(), now_s=1000.0)
    assert held.num_active == 4 and not held.changed and "waits for 1 draining" in held.reason
    done = PoolSignals(num_active=4, num_warm=2, num_total_blocks=400)
    assert decide(POLICY, done, ScalerState(), now_s=1000.0).num_drain == 1
    up = PoolSignals(num_active=4, num_warm=2, num_draining=1, num_queued_tokens=6000, num_total_blocks=400)
    assert decide(POLICY, up, ScalerState(), now_s=1000.0).num_active == 6  # a drain never holds a scale-up


def test_scale_to_zero_waits_for_the_idle_time_then_drains_streams_in_flight():
    policy = PoolPolicy(**{**POLICY.__dict__, "min_replicas": 0, "warm_replicas": 0, "scale_to_zero_idle_s": 600})

    def idle_for(seconds: float, num_active: int = 1, **more) -> PoolSignals:
        return PoolSignals(num_active=num_active, num_warm=0, num_total_blocks=100 * num_active,
                           seconds_since_last_request=seconds, **more)

    one = decide(policy, idle_for(30.0, num_active=2), ScalerState(), now_s=1000.0)
    assert (one.num_active, one.num_drain) == (1, 1)  # an empty queue fits no replica, but zero waits
    assert not decide(policy, idle_for(599.0), ScalerState(), 1000.0).changed
    # Idle long enough: zero, though a long stream still holds KV on the last replica (it drains there).
    zero = decide(policy, idle_for(600.0, num_used_blocks=50), ScalerState(), 1e3)
    assert (zero.num_active, zero.num_drain) == (0, 1) and "no request for 600s" in zero.reason
    queued = idle_for(900.0, num_queued_requests=1)
    assert not decide(policy, queued, ScalerState(), 1000.0).changed  # a request waiting is no idle model
    # Without an idle time, zero follows the load alone (the local supervisor's default).
    load_only = PoolPolicy(**{**policy.__dict__, "scale_to_zero_idle_s": 0.0})
    assert decide(load_only, idle_for(0.0), ScalerState(), 1e3).num_active == 0


def test_ratio_follows_token_mix():
    throughput = RoleThroughput(prefill_tokens_per_s=8000.0, decode_tokens_per_s=1000.0)
    policy = PoolPolicy(min_replicas=1, max_replicas=64)
    balanced = TokenMix(num_prompt_tokens=8000, num_output_tokens=1000)  # equal work per role
    assert prefill_decode_ratio(balanced, throughput) == 1.0
    assert prefill_replicas_for(10, balanced, throughput, policy) == 10
    prompt_heavy = TokenMix(num_prompt_tokens=32000, num_output_tokens=1000)  # RAG: long prompts
    assert prefill_replicas_for(10, prompt_heavy, throughput, policy) == 40
    chatty = TokenMix(num_prompt_tokens=4000, num_output_tokens=2000)  # long answers
    assert prefill_replicas_for(10, chatty, throughput, policy) == 3  # ceil(10 * 0.25)
    assert prefill_replicas_for(10, TokenMix(0, 0), throughput, policy) == 1  # min
    assert math.isinf(prefill_decode_ratio(TokenMix(10, 0), throughput))


def test_demand_counts_tokens_not_requests():
    many_short = PoolSignals(num_active=1, num_warm=0, num_queued_requests=500, num_queued_tokens=900)
    assert demand(POLICY, many_short).replicas == 1


@pytest.mark.parametrize("bad", [
    dict(min_replicas=3, max_replicas=2), dict(warm_replicas=-1), dict(target_kv_utilisation=0.0),
    dict(hysteresis=1.0), dict(ttft_p95_slo_s=0), dict(max_scale_down_step=0),
    dict(scale_to_zero_idle_s=-1.0),
])
def test_bad_policy_raises(bad):
    with pytest.raises(ValueError):
        PoolPolicy(**bad)


def test_bad_signals_raise():
    with pytest.raises(ValueError):
        PoolSignals(num_active=1, num_warm=0, num_used_blocks=5, num_total_blocks=4)
    with pytest.raises(ValueError):
        decide(POLICY, signals(1), ScalerState(), 0.0, num_starting=-1)
