"""The prefill pool's ratio floor, pure: decode size x the token mix's prefill:decode ratio, clamped."""

from __future__ import annotations

from flotilla.autoscaling.control import ScalerState, decide
from flotilla.autoscaling.policy import PoolPolicy, RoleThroughput
from flotilla.autoscaling.signals import PoolSignals, TokenMix
from flotilla.operator.ratio import decode_replicas, explain, prefill_floor, total_decode_replicas, with_floor

THROUGHPUT = RoleThroughput(prefill_tokens_per_s=4000.0, decode_tokens_per_s=1000.0)


def test_prompt_heavy_mix_raises_the_prefill_minimum_and_says_why():
    policy = PoolPolicy(min_replicas=1, max_replicas=8)
    floor = prefill_floor(policy, 3, TokenMix(6000, 1000), THROUGHPUT)  # ratio 1.5 -> ceil(4.5)
    assert floor.num_replicas == 5
    assert "ratio 1.50" in floor.reason and "3 decode" in floor.reason
    decision = explain(decide(with_floor(policy, floor), PoolSignals(num_active=1, num_warm=0), ScalerState(), 0.0),
                       floor)
    assert decision.num_active == 5 and decision.num_start == 4
    assert decision.reason.startswith("up 1->5") and decision.reason.endswith(floor.reason)


def test_floor_is_clamped_to_the_pools_own_bounds():
    policy = PoolPolicy(min_replicas=2, max_replicas=4)
    assert prefill_floor(policy, 10, TokenMix(8000, 100), THROUGHPUT).num_replicas == 4  # max
    assert prefill_floor(policy, 1, TokenMix(100, 8000), THROUGHPUT).num_replicas == 2  # min
    assert prefill_floor(policy, 3, TokenMix(800, 0), THROUGHPUT).num_replicas == 4  # no output yet: max
    assert with_floor(policy, None) == policy


def test_floor_never_lowers_a_pool_already_above_it():
    policy = PoolPolicy(min_replicas=1, max_replicas=8, scale_down_cooldown_s=0)
    floor = prefill_floor(policy, 2, TokenMix(4000, 1000), THROUGHPUT)  # ratio 1 -> 2
    busy = PoolSignals(num_active=6, num_warm=0, num_queued_tokens=6 * 2048)
    assert decide(with_floor(policy, floor), busy, ScalerState(), 0.0).num_active == 6


def test_decode_size_from_status():
    assert decode_replicas({}) is None
    assert decode_replicas({"desiredReplicas": 4, "activeReplicas": 3}) == 3  # warm decode serves nothing
    assert decode_replicas({"desiredReplicas": 4}) == 4
    assert total_decode_replicas([None, 2, 3]) == 5
    assert total_decode_replicas([None]) is None
