"""The prefill pool's floor, pure: the decode pool's size times the prefill:decode ratio of the measured
prompt/output token mix (flotilla.autoscaling.control.prefill_replicas_for), clamped to the prefill pool's
own min/max. The control law then treats the floor as a raised minimum, so a prompt-heavy mix grows the
prefill pool at once and no scale-down goes below it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from flotilla.autoscaling.control import Decision, prefill_decode_ratio, prefill_replicas_for
from flotilla.autoscaling.policy import PoolPolicy, RoleThroughput
from flotilla.autoscaling.signals import TokenMix


@dataclass(frozen=True)
class RatioFloor:
    num_replicas: int  # the prefill pool keeps at least this many active replicas
    reason: str


def decode_replicas(status: dict[str, Any]) -> int | None:
    """A decode pool's size from its status: the active replicas it wants (warm ones serve nothing), else
    its desired, else its ready replicas; None before its first decision."""
    for key in ("activeReplicas", "desiredReplicas", "readyReplicas"):
        if status.get(key) is not None:
            return int(status[key])
    return None


def total_decode_replicas(sizes: Iterable[int | None]) -> int | None:
    """Every decode pool of the model feeds from the same prefill pool: their sizes add up."""
    known = [size for size in sizes if size is not None]
    return sum(known) if known else None


def prefill_floor(policy: PoolPolicy, num_decode: int, mix: TokenMix, throughput: RoleThroughput) -> RatioFloor:
    num_replicas = prefill_replicas_for(num_decode, mix, throughput, policy)
    ratio = prefill_decode_ratio(mix, throughput)
    reason = (f"prefill:decode ratio {ratio:.2f} (prompt {mix.num_prompt_tokens:g} / output "
              f"{mix.num_output_tokens:g} tokens) x {num_decode} decode -> at least {num_replicas}")
    return RatioFloor(num_replicas, reason)


def with_floor(policy: PoolPolicy, floor: RatioFloor | None) -> PoolPolicy:
    if floor is None:
        return policy
    return dataclasses.replace(policy, min_replicas=max(policy.min_replicas, floor.num_replicas))


def explain(decision: Decision, floor: RatioFloor | None) -> Decision:
    """The decision with the floor's reason appended (the status says why the pool is this size)."""
    if floor is None:
        return decision
    return dataclasses.replace(decision, reason=f"{decision.reason}; {floor.reason}")
