"""Load test with a report: a seeded mixed workload (Poisson or bursty arrivals, multi-turn chats sharing
system prompts, long prompts, several tenants and tiers) streamed against an OpenAI-compatible endpoint,
optionally A/B against a second one in the same run (one after the other, same requests). Writes report.md
with latency CDFs and throughput / in-flight plots (PNG) into --out.

  .venv/bin/python loadtest/run_serving.py --base-url http://127.0.0.1:8080/v1 --model flotilla-tiny \
      --api-key $FLOTILLA_API_KEY --rate 4 --arrival bursty --num-requests 200 --out /tmp/flotilla-report \
      [--compare-base-url http://127.0.0.1:8000/v1 --compare-model NAME --compare-api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.serving.client import Endpoint, run_workload  # noqa: E402
from loadtest.serving.report import write_report  # noqa: E402
from loadtest.serving.stats import SLO, summarize  # noqa: E402
from loadtest.serving.workload import ARRIVALS, Tenant, WorkloadConfig, build_workload  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    p.add_argument("--tenant", action="append", default=[], metavar="NAME:TIER[:KEY[:WEIGHT]]",
                   help="repeatable; default one tenant 'default' of tier 'paid' with --api-key")
    p.add_argument("--compare-base-url", help="B endpoint: the same requests, after A")
    p.add_argument("--compare-model")
    p.add_argument("--compare-api-key", default=os.environ.get("COMPARE_API_KEY", "none"))
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=4.0, help="mean requests/s")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--chat-share", type=float, default=0.3)
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--output-tokens", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="report directory")
    return p.parse_args(argv)


def parse_tenant(text: str) -> Tenant:
    parts = text.split(":")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise SystemExit(f"--tenant expects NAME:TIER[:KEY[:WEIGHT]], got {text!r}")
    weight = float(parts[3]) if len(parts) > 3 else 1.0
    return Tenant(parts[0], parts[1], parts[2] if len(parts) > 2 else "", weight)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tenants = tuple(parse_tenant(t) for t in args.tenant) or (Tenant("default", "paid"),)
    config = WorkloadConfig(num_requests=args.num_requests, rate=args.rate, arrival=args.arrival,
                            chat_share=args.chat_share, long_share=args.long_share,
                            output_tokens=tuple(args.output_tokens), tenants=tenants, seed=args.seed)
    specs = build_workload(config)
    endpoints = [Endpoint("A: " + args.model, args.base_url.rstrip("/"), args.model, args.api_key, args.ignore_eos)]
    if args.compare_base_url:
        model = args.compare_model or args.model
        endpoints.append(Endpoint("B: " + model, args.compare_base_url.rstrip("/"), model, args.compare_api_key,
                                  args.ignore_eos, use_tenant_keys=False))
    runs = [asyncio.run(run_workload(e, specs, args.max_concurrency)) for e in endpoints]
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    workload = (f"{args.num_requests} requests, {args.arrival} arrivals at {args.rate}/s, chat share "
                f"{args.chat_share}, long share {args.long_share}, tenants {[t.name + '/' + t.tier for t in tenants]}, "
                f"seed {args.seed}")
    path = write_report(args.out, runs, slo, "Flotilla serving load test", workload)
    print(f"report: {path}")
    print(json.dumps([{k: v for k, v in summarize(run, slo).items() if k != "by_tier"} for run in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
