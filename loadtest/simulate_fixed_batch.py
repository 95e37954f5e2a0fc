"""Plans accelerators for a fixed run_batch contract by simulating the router's batching policy
(router/batch_dispatcher.py: flush when B calls wait or the oldest waited T, to any idle accelerator, each call
taking exactly L) on Poisson arrivals, beyond the rates this machine's Python HTTP path can carry. For each case,
the fewest accelerators whose p95 (queueing + L) stays within the budget, next to the floor rps / (B / L), with the
mean batch fill at that count. Latencies are those of the calls that arrived in the second half of the run
(a fleet at or above saturation shows a growing queue there, not a warm-up). A discrete-event simulation: no sockets, no sleeping; the policy is the
dispatcher's, the numbers are the model's (no CPU cost per call, no network).

  .venv/bin/python loadtest/simulate_fixed_batch.py                      # 2,000 rps B=50 L=200; 10,000 rps B=100 L=100
  .venv/bin/python loadtest/simulate_fixed_batch.py --case 500 50 200 --duration-s 20
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import deque


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Open-loop arrival times in [0, duration_s) at `rate` per second (exponential gaps)."""
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return arrivals
        arrivals.append(t)


def simulate(rate: float, batch_size: int, latency_s: float, num_accelerators: int, max_wait_s: float,
             duration_s: float, seed: int) -> dict:
    arrivals = poisson_arrivals(rate, duration_s, random.Random(seed))
    free_at = [0.0] * num_accelerators  # heap of when each accelerator is next idle
    heapq.heapify(free_at)
    queue: deque[float] = deque()
    latencies, sizes = [], []
    i, now = 0, 0.0
    while i < len(arrivals) or queue:
        # The next moment something can happen: an arrival, an accelerator freeing, the oldest call's T.
        candidates = [arrivals[i]] if i < len(arrivals) else []
        if queue:
            candidates.append(max(free_at[0], queue[0] + max_wait_s if len(queue) < batch_size else free_at[0]))
        now = max(now, min(candidates))
        while i < len(arrivals) and arrivals[i] <= now:
            queue.append(arrivals[i])
            i += 1
        while queue and free_at[0] <= now and (len(queue) >= batch_size or now - queue[0] >= max_wait_s - 1e-12):
            heapq.heappop(free_at)
            batch = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
            done = now + latency_s
            latencies += [done - a for a in batch if a >= duration_s / 2]  # steady state: the second half
            sizes.append(len(batch))
            heapq.heappush(free_at, done)
    latencies.sort()
    p95 = latencies[int(0.95 * len(latencies))] if latencies else math.nan
    return {"p95_ms": p95 * 1e3, "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "mean_fill": sum(sizes) / len(sizes) / batch_size, "num_batches": len(sizes)}


def plan(rate: float, batch_size: int, latency_ms: float, budget_ms: float, max_wait_ms: float | None,
         duration_s: float, seed: int) -> dict:
    latency_s = latency_ms / 1000
    max_wait_s = (max_wait_ms if max_wait_ms is not None else max(0.0, budget_ms - 2 * latency_ms)) / 1000
    floor = rate / (batch_size / latency_s)
    n = max(1, math.ceil(floor))
    while True:
        result = simulate(rate, batch_size, latency_s, n, max_wait_s, duration_s, seed)
        if result["p95_ms"] <= budget_ms or n > 20 * floor + 20:
            break
        n += 1
    spare = simulate(rate, batch_size, latency_s, n + 1, max_wait_s, duration_s, seed)
    return {"rate": rate, "batch_size": batch_size, "latency_ms": latency_ms, "max_wait_ms": max_wait_s * 1e3,
            "budget_ms": budget_ms, "floor_accelerators": round(floor, 2), "accelerators_needed": n,
            "p50_ms": round(result["p50_ms"], 1), "p95_ms": round(result["p95_ms"], 1),
            "mean_batch_fill": round(result["mean_fill"], 3),
            # At the floor the accelerators are busy all the time (utilisation 1): the queue is a random walk and
            # grows with the horizon and with any burst. One more accelerator, for comparison:
            "p95_ms_one_more": round(spare["p95_ms"], 1), "mean_batch_fill_one_more": round(spare["mean_fill"], 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", type=float, nargs=3, action="append", metavar=("RPS", "B", "L_MS"),
                   help="default: 2000 50 200 and 10000 100 100")
    p.add_argument("--budget-ms", type=float, default=500.0)
    p.add_argument("--max-wait-ms", type=float, default=None, help="T (default: budget - 2 L, as the router)")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cases = args.case or [(2000, 50, 200), (10000, 100, 100)]
    rows = [plan(rate, int(b), l_ms, args.budget_ms, args.max_wait_ms, args.duration_s, args.seed)
            for rate, b, l_ms in cases]
    for row in rows:
        print(f"{row['rate']:8.0f} rps  B={row['batch_size']:<4d} L={row['latency_ms']:.0f} ms  T={row['max_wait_ms']:.0f} ms"
              f"  floor {row['floor_accelerators']:.2f}  needed {row['accelerators_needed']}  fill "
              f"{row['mean_batch_fill']:.3f}  p50 {row['p50_ms']:.0f}  p95 {row['p95_ms']:.0f} ms;  one more: p95 "
              f"{row['p95_ms_one_more']:.0f} ms, fill {row['mean_batch_fill_one_more']:.3f}")
    print(json.dumps({"bench": "simulate_fixed_batch", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
