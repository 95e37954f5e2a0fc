"""Interactive TPOT under overload with and without the batch bound (worker --target-tpot-ms), on the real fleet.

Two fleets (gateway, router, one worker each, as processes) differ only in the worker's --target-tpot-ms: `off`
(up to --max-num-seqs sequences per step) and the bound (default: auto, 40 ms on a CPU). Both run at once, but
only one carries load at a time, and rounds alternate between them (off, bound, off, bound, ...), so that the
shared machine's load changes hit both alike. A round: --batch-streams closed-loop batch-class completions
(x-flotilla-priority: batch) and --interactive-streams closed-loop streamed interactive ones, together more
sequences than the worker can step through under the target; after --warmup-s, for --round-s, each finished
interactive request gives one TPOT (first to last token / (tokens - 1)). Reports per round TPOT p50/p95 and the
batch tokens/s (what the bound costs), the medians over rounds, and last ONE JSON line.

  .venv/bin/python loadtest/bench_tpot_bound.py
  .venv/bin/python loadtest/bench_tpot_bound.py --rounds 5 --target-tpot-ms 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from loadtest.common.checkpoint_cache import ensure_checkpoint  # noqa: E402

MODEL = "flotilla-tiny"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("micro", "tiny", "small"), default="tiny")
    p.add_argument("--target-tpot-ms", default="25", help="the bounded fleet's worker flag (auto: 40 on cpu)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="both workers; the router places as many")
    p.add_argument("--batch-streams", type=int, default=56)
    p.add_argument("--interactive-streams", type=int, default=8)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--interactive-max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="per fleet")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--round-s", type=float, default=10.0)
    return p.parse_args(argv)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


async def interactive(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> float:
    """One streamed completion's TPOT: first to last token / (tokens - 1)."""
    body = {"model": MODEL, "prompt": [7 + i % 50, 11, 13, 17 + i % 7], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    first = last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                last = time.perf_counter()
                first = first or last
    if first is None or last is None:
        raise RuntimeError("an interactive request streamed no token")
    return (last - first) / (max_tokens - 1)


async def batch(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> int:
    body = {"model": MODEL, "prompt": [3 + i % 200, 5, 8, 13, 21], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    response = await client.post(f"{url}/v1/completions", json=body, headers={"x-flotilla-priority": "batch"})
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


async def one_round(url: str, args: argparse.Namespace) -> dict:
    measuring = {"on": False}
    tpots: list[float] = []
    batch_tokens = [0]
    stop = asyncio.Event()

    async def interactive_loop(worker: int) -> None:
        i = worker
        while not stop.is_set():
            started_in = measuring["on"]
            tpot = await interactive(client, url, i, args.interactive_max_tokens)
            if started_in and measuring["on"]:
                tpots.append(tpot)
            i += args.interactive_streams

    async def batch_loop(worker: int) -> None:
        i = worker
        while not stop.is_set():
            tokens = await batch(client, url, i, args.batch_max_tokens)
            if measuring["on"]:
                batch_tokens[0] += tokens
            i += args.batch_streams

    limits = httpx.Limits(max_connections=args.batch_streams + args.interactive_streams + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        loops = [asyncio.create_task(batch_loop(w)) for w in range(args.batch_streams)]
        loops += [asyncio.create_task(interactive_loop(w)) for w in range(args.interactive_streams)]
        await asyncio.sleep(args.warmup_s)  # the worker fills up to its running batch
        measuring["on"] = True
        started = time.perf_counter()
        await asyncio.sleep(args.round_s)
        measuring["on"] = False
        elapsed = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*loops)
    if len(tpots) < 5:
        raise RuntimeError(f"only {len(tpots)} interactive requests finished in the round")
    return {"tpot_p50_ms": statistics.median(tpots) * 1000, "tpot_p95_ms": p95(tpots) * 1000,
            "interactive_requests": len(tpots), "batch_tokens_per_s": batch_tokens[0] / elapsed,
            "loadavg_1m": os.getloadavg()[0]}


def fleet_config(model_dir: Path, state: Path, target: str, args: argparse.Namespace):
    from flotilla.fleet.local import FleetConfig

    return FleetConfig(model_dir=model_dir, state_dir=state, model_name=MODEL, metrics=False,
                       env={"OMP_NUM_THREADS": "1"},
                       worker_args=["--output-check-interval-s", "0", "--max-num-seqs", str(args.max_num_seqs),
                                    "--target-tpot-ms", target],
                       router_args=["--max-requests-per-worker", str(args.max_num_seqs)])


def main(argv: list[str] | None = None) -> int:
    from flotilla.fleet.local import LocalFleet

    args = parse_args(argv)
    model_dir = ensure_checkpoint(Path.home() / ".cache" / "flotilla" / "bench", args.size)
    runs: dict[str, list[dict]] = {"off": [], "bound": []}
    with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as stack:
        urls = {}
        for name, target in (("off", "off"), ("bound", args.target_tpot_ms)):
            fleet = stack.enter_context(LocalFleet(fleet_config(model_dir, Path(state) / name, target, args)))
            urls[name] = fleet.gateway_url
        for round_index in range(args.rounds):
            for name in ("off", "bound"):
                result = asyncio.run(one_round(urls[name], args))
                runs[name].append(result)
                print(f"round {round_index + 1} {name:5s}: TPOT p50 {result['tpot_p50_ms']:.1f} ms p95 "
                      f"{result['tpot_p95_ms']:.1f} ms ({result['interactive_requests']} requests), batch "
                      f"{result['batch_tokens_per_s']:.0f} tok/s, load {result['loadavg_1m']:.1f}", flush=True)
    medians = {name: {key: statistics.median(r[key] for r in results)
                      for key in ("tpot_p50_ms", "tpot_p95_ms", "batch_tokens_per_s")}
               for name, results in runs.items()}
    for name, median in medians.items():
        print(f"median of {args.rounds} rounds, {name:5s}: TPOT p50 {median['tpot_p50_ms']:.1f} ms p95 "
              f"{median['tpot_p95_ms']:.1f} ms, batch {median['batch_tokens_per_s']:.0f} tok/s")
    print(json.dumps({"size": args.size, "target_tpot_ms": args.target_tpot_ms, "max_num_seqs": args.max_num_seqs,
                      "batch_streams": args.batch_streams, "interactive_streams": args.interactive_streams,
                      "rounds": runs, "medians": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
