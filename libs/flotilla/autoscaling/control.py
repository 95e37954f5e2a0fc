"""The control law, pure: from a pool's signals and policy to a scaling decision. No clocks, no I/O.

One law drives the Kubernetes operator (FlotillaPool) and the local supervisor (`flotilla up --autoscale`):

- Demand in replicas is the largest of: queued tokens / target per replica; used KV blocks / (blocks per
  replica x target utilisation); and, while p95 TTFT misses its SLO, the current count scaled by the miss
  (at most doubled; ignored for `ttft_settle_s` after a scale-up, while the p95 window still holds the
  requests from before it). Capacity is counted in tokens and free KV, never in request counts or GPU busy time.
- Fast up: demand above the current count scales up at once (after `scale_up_cooldown_s`), straight to the
  demand, promoting warm replicas first (seconds) and cold-starting only the rest.
- Slow down, with hysteresis: demand is recomputed at (1 - hysteresis) of every target; only when even
  that fits fewer replicas, and `scale_down_cooldown_s` passed since the last change, does the pool shrink,
  by at most `max_scale_down_step`. A load that just triggered a scale-up therefore never triggers the
  scale-down that would undo it (no oscillation).
- One drain at a time: while any replica of the pool is draining, no further scale-down is decided (a drain
  that does not finish holds the pool at its size instead of stacking up more of them).
- Scale to zero (min_replicas 0) waits for `scale_to_zero_idle_s` without a new request, when set; then the
  last replicas drain even with streams in flight (they finish on them). Until then the pool keeps one.
- The warm pool is refilled behind every promotion; a replica leaving rotation refills it first (demote:
  no cold start) and is drained (no new work, in-flight streams finish) only when the pool is full.
- New replicas always start warm: the router keeps them out of rotation and the next decision promotes
  them, so a replica only serves once its weights are loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flotilla.autoscaling.policy import PoolPolicy, RoleThroughput
from flotilla.autoscaling.signals import PoolSignals, TokenMix

NEVER = -math.inf
MAX_TTFT_FACTOR = 2.0  # a TTFT miss at most doubles the pool per decision


@dataclass(frozen=True)
class ScalerState:
    """What the law remembers between decisions (the operator keeps it in the pool's status)."""

    last_scale_up_s: float = NEVER
    last_scale_down_s: float = NEVER


@dataclass(frozen=True)
class Decision:
    num_active: int  # active replicas wanted once this decision is applied
    num_warm: int  # warm replicas wanted (the policy's warm pool size)
    num_promote: int  # warm -> active now
    num_demote: int  # active -> warm now (refills the warm pool without a cold start)
    num_drain: int  # active -> draining, stopped once idle
    num_retire_warm: int  # surplus warm replicas to stop
    num_start: int  # new replicas to cold-start (they register warm)
    reason: str
    state: ScalerState

    @property
    def changed(self) -> bool:
        return any((self.num_promote, self.num_demote, self.num_drain, self.num_retire_warm, self.num_start))


@dataclass(frozen=True)
class Demand:
    replicas: int
    reason: str


def demand(policy: PoolPolicy, signals: PoolSignals, target_factor: float = 1.0, use_ttft: bool = True) -> Demand:
    """Replicas the measured load needs with every target multiplied by target_factor (< 1 for scale-down).
    use_ttft False: ignore TTFT (right after a scale-up its p95 still holds the requests from before)."""
    current = signals.num_active
    candidates = [Demand(0, "idle")]
    per_replica_tokens = policy.target_queued_tokens_per_replica * target_factor
    if signals.num_queued_tokens:
        replicas = math.ceil(signals.num_queued_tokens / per_replica_tokens)
        candidates.append(Demand(replicas, f"queued tokens {signals.num_queued_tokens}"))
    if signals.num_used_blocks and signals.num_blocks_per_replica:
        usable = signals.num_blocks_per_replica * policy.target_kv_utilisation * target_factor
        replicas = math.ceil(signals.num_used_blocks / usable)
        candidates.append(Demand(replicas, f"KV utilisation {signals.kv_utilisation:.0%}"))
    slo_s = policy.ttft_p95_slo_s * target_factor
    if use_ttft and signals.ttft_p95_s > slo_s and current:
        factor = min(MAX_TTFT_FACTOR, signals.ttft_p95_s / slo_s)
        replicas = max(current + 1, math.ceil(current * factor))
        candidates.append(Demand(replicas, f"TTFT p95 {signals.ttft_p95_s:.2f}s > SLO {slo_s:.2f}s"))
    return max(candidates, key=lambda d: d.replicas)


def clamp(policy: PoolPolicy, replicas: int) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, replicas))


def decide(
    policy: PoolPolicy, signals: PoolSignals, state: ScalerState, now_s: float, num_starting: int = 0
) -> Decision:
    """The decision for this tick. num_starting: replicas started but not registered yet (they count as
    warm-to-be, so a slow start is not started twice)."""
    if num_starting < 0:
        raise ValueError("num_starting must be >= 0")
    current = signals.num_active
    settled = now_s - state.last_scale_up_s >= policy.ttft_settle_s
    up = demand(policy, signals, use_ttft=settled)
    target_up = clamp(policy, up.replicas)
    if target_up > current and (current < policy.min_replicas or
                                now_s - state.last_scale_up_s >= policy.scale_up_cooldown_s):
        return _scale_up(policy, signals, state, now_s, num_starting, target_up, up.reason)
    down = _down_demand(policy, signals)
    target_down = clamp(policy, down.replicas)
    last_change_s = max(state.last_scale_up_s, state.last_scale_down_s)
    if target_down < current and now_s - last_change_s >= policy.scale_down_cooldown_s:
        if signals.num_draining:
            return _steady(policy, signals, state, num_starting,
                           f"hold: scale-down to {target_down} waits for {signals.num_draining} draining")
        return _scale_down(policy, signals, state, now_s, num_starting, target_down, down.reason)
    reason = "hold" if target_up <= current else f"hold: scale-up cooling down ({up.reason})"
    return _steady(policy, signals, state, num_starting, reason)


def _down_demand(policy: PoolPolicy, signals: PoolSignals) -> Demand:
    """The demand a scale-down goes to: the load at (1 - hysteresis) of every target; with a scale-to-zero
    idle time, zero only once the model got no request for that long (then zero whatever is in flight)."""
    down = demand(policy, signals, 1.0 - policy.hysteresis)
    if policy.min_replicas > 0 or not policy.scale_to_zero_idle_s:
        return down
    idle_s = signals.seconds_since_last_request
    if idle_s >= policy.scale_to_zero_idle_s and not signals.num_queued_requests:
        return Demand(0, f"idle: no request for {idle_s:.0f}s")
    return Demand(max(1, down.replicas), down.reason)


def _scale_up(policy, signals, state, now_s, num_starting, target, why) -> Decision:
    current = signals.num_active
    promote = min(signals.num_warm, target - current)
    warm_after = signals.num_warm - promote
    # Still-missing active replicas plus the warm pool refill; started ones become warm, then promoted.
    missing = (target - current - promote) + max(0, policy.warm_replicas - warm_after)
    start = max(0, missing - num_starting)
    reason = f"up {current}->{target} ({why}): promoted {promote} warm, starting {start}"
    return Decision(target, policy.warm_replicas, promote, 0, 0, 0, start, reason,
                    ScalerState(now_s, state.last_scale_down_s))


def _scale_down(policy, signals, state, now_s, num_starting, target, why) -> Decision:
    current = signals.num_active
    leaving = min(policy.max_scale_down_step, current - target)
    target = current - leaving
    demote = min(leaving, max(0, policy.warm_replicas - signals.num_warm - num_starting))
    drain = leaving - demote
    reason = f"down {current}->{target} ({why}): demoted {demote} to warm, draining {drain}"
    return Decision(target, policy.warm_replicas, 0, demote, drain, 0, 0, reason,
                    ScalerState(state.last_scale_up_s, now_s))


def _steady(policy, signals, state, num_starting, reason) -> Decision:
    """No change in rotation; keep the warm pool at its size (refill or retire)."""
    warm = signals.num_warm + num_starting
    start = max(0, policy.warm_replicas - warm)
    retire = max(0, signals.num_warm - policy.warm_replicas)
    if start:
        reason += f"; refilling warm pool: starting {start}"
    if retire:
        reason += f"; retiring {retire} surplus warm"
    return Decision(signals.num_active, policy.warm_replicas, 0, 0, 0, retire, start, reason, state)


# ---- prefill:decode ratio ----------------------------------------------------------------------------
def prefill_decode_ratio(mix: TokenMix, throughput: RoleThroughput) -> float:
    """Prefill replicas per decode replica that the measured token mix needs: each role's share of work is
    its tokens divided by what one replica of that role processes per second."""
    decode_work = mix.num_output_tokens / throughput.decode_tokens_per_s
    prefill_work = mix.num_prompt_tokens / throughput.prefill_tokens_per_s
    if decode_work == 0:
        return 0.0 if prefill_work == 0 else math.inf
    return prefill_work / decode_work


def prefill_replicas_for(num_decode: int, mix: TokenMix, throughput: RoleThroughput, policy: PoolPolicy) -> int:
    """The prefill pool size that keeps pace with num_decode decode replicas under this mix."""
    ratio = prefill_decode_ratio(mix, throughput)
    if math.isinf(ratio):
        return policy.max_replicas
    return clamp(policy, math.ceil(num_decode * ratio))
