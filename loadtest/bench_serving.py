"""Serving benchmark against any OpenAI-compatible base URL (Flotilla's gateway, vLLM, ...): requests arrive
as a Poisson process at --request-rate (inf: all at once) and/or under --max-concurrency; each streams its
answer. Prints TTFT / TPOT / ITL / e2e p50/p95/p99, throughput and errors, and last ONE JSON line.

  .venv/bin/python loadtest/bench_serving.py --base-url http://127.0.0.1:8080/v1 --model flotilla-tiny \
      --api-key $FLOTILLA_API_KEY --request-rate 4 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.serving.client import Endpoint, run_workload  # noqa: E402
from loadtest.serving.stats import SLO, summarize  # noqa: E402
from loadtest.serving.workload import WorkloadConfig, build_workload  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="OpenAI-compatible base URL, ending in /v1")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-words", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"))
    p.add_argument("--ignore-eos", action="store_true", help="ask for exact output lengths (vLLM honours it)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = WorkloadConfig(num_requests=args.num_prompts, rate=args.request_rate, arrival="poisson",
                              input_words=tuple(args.input_words), output_tokens=tuple(args.output_tokens),
                              seed=args.seed)
    endpoint = Endpoint("target", args.base_url.rstrip("/"), args.model, args.api_key, args.ignore_eos)
    run = asyncio.run(run_workload(endpoint, build_workload(workload), args.max_concurrency,
                                   progress=not args.no_progress))
    summary = summarize(run, SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000))
    print_summary(summary)
    line = flat_summary(summary, args)
    print(json.dumps(line))
    return 0 if summary["num_ok"] else 1


def print_summary(summary: dict) -> None:
    print(f"requests {summary['num_requests']}  ok {summary['num_ok']}  errors {summary['errors'] or 0}  "
          f"duration {summary['duration_s']:.2f} s")
    print(f"throughput {summary['request_throughput']:.2f} req/s, {summary['output_tok_s']:.1f} output tok/s, "
          f"goodput {summary['goodput_req_s']:.2f} req/s")
    for key, row in summary["latency"].items():
        cells = "  ".join(f"{name} {_ms(value)}" for name, value in row.items())
        print(f"{key[:-2].upper():5s} ms  {cells}")


def flat_summary(summary: dict, args: argparse.Namespace) -> dict:
    line = {"base_url": args.base_url, "model": args.model, "num_prompts": args.num_prompts,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "max_concurrency": args.max_concurrency, "seed": args.seed}
    for key in ("num_ok", "num_errors", "errors", "duration_s", "request_throughput", "output_tokens",
                "prompt_tokens", "output_tok_s", "goodput_req_s", "slo_attainment"):
        line[key] = summary[key]
    for metric, row in summary["latency"].items():
        for stat, value in row.items():
            line[f"{metric[:-2]}_{stat}_ms"] = None if value is None else round(value * 1000, 3)
    return line


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


if __name__ == "__main__":
    sys.exit(main())
