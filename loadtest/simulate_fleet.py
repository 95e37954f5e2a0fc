"""Trace-driven simulation of a large fleet under the real control law (flotilla.autoscaling.control).

Planning past this machine: hundreds of replicas, cold starts of minutes, the measured per-replica token
throughput as input. A trace of request cohorts (one per second: Poisson count, lognormal prompt and output
lengths) runs at a baseline rate with a 3x burst in the middle; a fluid FIFO queue serves them at
(active replicas x tokens per second). Every `--interval-s` the control law reads the signals a router would
report (queued tokens, TTFT p95 over the last minute) and its decision is applied with real delays:
promoting a warm replica takes `--promote-s`, a cold start `--cold-start-s` (then it registers warm and the
next decision promotes it), draining takes `--drain-s`.

For each warm-pool size it prints SLO attainment (requests whose TTFT met the SLO), TTFT p95/p99 and
replica-hours (every replica that holds a GPU: active, warm, starting, draining).

    .venv/bin/python loadtest/simulate_fleet.py                       # defaults below
    .venv/bin/python loadtest/simulate_fleet.py --replica-tokens-per-s 3100 --warm 0 8 32 64
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from flotilla.autoscaling.control import ScalerState, decide
from flotilla.autoscaling.policy import PoolPolicy
from flotilla.autoscaling.signals import PoolSignals


@dataclass(frozen=True)
class Trace:
    arrivals: np.ndarray  # requests per second
    work: np.ndarray  # token work per second: prompt tokens x prompt_cost + output tokens


def make_trace(args: argparse.Namespace) -> Trace:
    rng = np.random.default_rng(args.seed)
    seconds = int(args.duration_min * 60)
    rate = np.full(seconds, args.base_rps, dtype=float)
    start, end = int(args.burst_start_min * 60), int((args.burst_start_min + args.burst_min) * 60)
    rate[start:end] *= args.burst_factor
    arrivals = rng.poisson(rate)
    prompt = rng.lognormal(math.log(args.prompt_tokens), 0.6, size=arrivals.sum())
    output = rng.lognormal(math.log(args.output_tokens), 0.6, size=arrivals.sum())
    per_request = prompt * args.prompt_cost + output
    bounds = np.concatenate([[0], np.cumsum(arrivals)])
    work = np.add.reduceat(per_request, bounds[:-1]) * (arrivals > 0) if len(per_request) else np.zeros(seconds)
    return Trace(arrivals, work)


@dataclass
class Fleet:
    active: int
    warm: int
    starting: list[float] = field(default_factory=list)  # ready-at times (heap): they register warm
    promoting: list[float] = field(default_factory=list)  # in rotation at these times
    draining: list[float] = field(default_factory=list)  # gone at these times

    def advance(self, now: float) -> None:
        while self.starting and self.starting[0] <= now:
            heapq.heappop(self.starting)
            self.warm += 1
        while self.promoting and self.promoting[0] <= now:
            heapq.heappop(self.promoting)
            self.active += 1
        while self.draining and self.draining[0] <= now:
            heapq.heappop(self.draining)

    @property
    def num_holding_gpus(self) -> int:
        return self.active + self.warm + len(self.starting) + len(self.promoting) + len(self.draining)


@dataclass(frozen=True)
class Result:
    warm: int
    slo_attainment: float
    ttft_p95_s: float
    ttft_p99_s: float
    replica_hours: float
    peak_replicas: int
    num_requests: int


def simulate(trace: Trace, policy: PoolPolicy, args: argparse.Namespace) -> Result:
    capacity = args.replica_tokens_per_s
    fleet = Fleet(active=policy.min_replicas, warm=policy.warm_replicas)
    queue: deque[list[float]] = deque()  # [arrival second, remaining work, requests]
    ttfts: list[tuple[float, int]] = []  # (seconds, requests)
    recent: deque[tuple[int, float, int]] = deque()  # (at, ttft, requests) for the p95 signal
    state, gpu_seconds, peak = ScalerState(), 0.0, 0
    for now in range(len(trace.arrivals)):
        fleet.advance(now)
        if trace.arrivals[now]:
            queue.append([now, float(trace.work[now]), int(trace.arrivals[now])])
        budget = fleet.active * capacity
        while queue and budget > 0:
            cohort = queue[0]
            if cohort[2] and cohort[1] == trace.work[cohort[0]]:  # its first tokens start now
                ttft = now - cohort[0] + args.base_ttft_s
                ttfts.append((ttft, cohort[2]))
                recent.append((now, ttft, cohort[2]))
            served = min(budget, cohort[1])
            cohort[1] -= served
            budget -= served
            if cohort[1] <= 0:
                queue.popleft()
        while recent and recent[0][0] < now - args.window_s:
            recent.popleft()
        gpu_seconds += fleet.num_holding_gpus
        peak = max(peak, fleet.num_holding_gpus)
        if now % args.interval_s == 0:
            state = _control(fleet, queue, recent, policy, state, now, args)
    return _result(policy.warm_replicas, ttfts, gpu_seconds, peak, queue, args.slo_s)


def _control(fleet, queue, recent, policy, state, now, args) -> ScalerState:
    signals = PoolSignals(num_active=fleet.active, num_warm=fleet.warm,
                          num_queued_tokens=int(sum(c[1] for c in queue)), ttft_p95_s=_p95(recent))
    decision = decide(policy, signals, state, float(now), len(fleet.starting))
    fleet.warm -= decision.num_promote
    for _ in range(decision.num_promote):
        heapq.heappush(fleet.promoting, now + args.promote_s)
    leaving = decision.num_demote + decision.num_drain
    fleet.active -= leaving
    fleet.warm += decision.num_demote - decision.num_retire_warm
    for _ in range(decision.num_drain + decision.num_retire_warm):
        heapq.heappush(fleet.draining, now + args.drain_s)
    for _ in range(decision.num_start):
        heapq.heappush(fleet.starting, now + args.cold_start_s)
    return decision.state


def _p95(recent) -> float:
    if not recent:
        return 0.0
    values = np.array([t for _, t, _ in recent])
    weights = np.array([n for _, _, n in recent], dtype=float)
    return _weighted_quantile(values, weights, 0.95)


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, q * cumulative[-1])])


def _result(warm, ttfts, gpu_seconds, peak, queue, slo_s) -> Result:
    values = np.array([t for t, _ in ttfts] + [math.inf] * len(queue))  # still queued at the end: missed
    weights = np.array([n for _, n in ttfts] + [c[2] for c in queue], dtype=float)
    met = weights[values <= slo_s].sum() / weights.sum()
    return Result(warm, float(met), _weighted_quantile(values, weights, 0.95),
                  _weighted_quantile(values, weights, 0.99), gpu_seconds / 3600, peak, int(weights.sum()))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica-tokens-per-s", type=float, default=2500.0,
                   help="measured token work one replica sustains (e.g. from loadtest/bench_engine.py on the GPU)")
    p.add_argument("--base-rps", type=float, default=1000.0, help="baseline requests per second")
    p.add_argument("--burst-factor", type=float, default=3.0)
    p.add_argument("--burst-start-min", type=float, default=20.0)
    p.add_argument("--burst-min", type=float, default=20.0)
    p.add_argument("--duration-min", type=float, default=75.0)
    p.add_argument("--prompt-tokens", type=float, default=600.0, help="median prompt length")
    p.add_argument("--output-tokens", type=float, default=200.0, help="median output length")
    p.add_argument("--prompt-cost", type=float, default=0.125, help="work of one prompt token vs one output token")
    p.add_argument("--cold-start-s", type=float, default=240.0, help="pod scheduled to weights loaded")
    p.add_argument("--promote-s", type=float, default=2.0, help="warm replica into rotation")
    p.add_argument("--drain-s", type=float, default=60.0)
    p.add_argument("--interval-s", type=int, default=10, help="operator rescale period")
    p.add_argument("--window-s", type=float, default=60.0, help="TTFT p95 signal window")
    p.add_argument("--base-ttft-s", type=float, default=0.3, help="TTFT of a request that does not queue")
    p.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO")
    p.add_argument("--min-replicas", type=int, default=0, help="default: the baseline load at 80%% of a replica")
    p.add_argument("--max-replicas", type=int, default=600)
    p.add_argument("--warm", type=int, nargs="+", default=[0, 50, 100, 200, 300])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    trace = make_trace(args)
    mean_work = trace.work.sum() / len(trace.work)  # per second, whole trace
    # Default floor: the baseline load at 80% of each replica's throughput (headroom for Poisson noise).
    baseline = args.base_rps * trace.work.sum() / trace.arrivals.sum() / args.replica_tokens_per_s
    min_replicas = args.min_replicas or int(math.ceil(baseline / 0.8))
    print(f"trace: {trace.arrivals.sum():,} requests over {args.duration_min:.0f} min, {args.base_rps:.0f} rps with a "
          f"{args.burst_factor:.0f}x burst for {args.burst_min:.0f} min; mean work {mean_work:,.0f} tokens/s; "
          f"one replica {args.replica_tokens_per_s:,.0f} tokens/s; cold start {args.cold_start_s:.0f} s; "
          f"min replicas {min_replicas} (baseline load / 0.8), max {args.max_replicas}")
    print(f"{'warm':>5} {'SLO met':>8} {'TTFT p95':>9} {'TTFT p99':>9} {'replica-h':>10} {'peak':>5}")
    for warm in args.warm:
        # Queued tokens per replica: about one TTFT SLO worth of work, so a backlog that would miss it scales.
        policy = PoolPolicy(
            min_replicas=min_replicas, max_replicas=args.max_replicas, warm_replicas=warm,
            target_queued_tokens_per_replica=int(args.replica_tokens_per_s * args.slo_s / 2),
            ttft_p95_slo_s=args.slo_s, ttft_settle_s=args.window_s,
            scale_up_cooldown_s=0.0, scale_down_cooldown_s=300.0, hysteresis=0.2,
            max_scale_down_step=max(1, min_replicas // 10),
        )
        r = simulate(trace, policy, args)
        print(f"{r.warm:>5} {r.slo_attainment:>8.2%} {r.ttft_p95_s:>8.2f}s {r.ttft_p99_s:>8.2f}s "
              f"{r.replica_hours:>10.1f} {r.peak_replicas:>5}")


if __name__ == "__main__":
    main()
