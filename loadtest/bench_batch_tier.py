"""The batch tier against interactive traffic, on the real fleet (gateway, router, one worker as processes): the
scaled-down form of issue 18's mixed test (500 items on a GPU fleet), sized for a 2-core CPU.

Three phases, one run: (1) interactive probes alone (streamed completions one after another: TTFT); (2) the
same probes while an OpenAI batch job of --batch-items items runs (`/v1/files` + `/v1/batches`); (3) the probes
stop and the batch runs alone until it completes. Reports TTFT p50/p95 of (1) and (2) and their ratio (the
issue's bar: p95 within 1.5x), the batch's items per second during (2) and (3) (the tier fills the trough), and
last ONE JSON line.

  .venv/bin/python loadtest/bench_batch_tier.py
  .venv/bin/python loadtest/bench_batch_tier.py --batch-items 200 --probes 60 --batch-concurrency 8
  .venv/bin/python loadtest/bench_batch_tier.py --no-hold-batch   # batch sequences beside interactive prefills
"""

from __future__ import annotations

import argparse
import io
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
    p.add_argument("--batch-items", type=int, default=100)
    p.add_argument("--batch-max-tokens", type=int, default=32)
    p.add_argument("--batch-concurrency", type=int, default=4, help="the gateway's --batch-concurrency-per-tenant")
    p.add_argument("--no-hold-batch", action="store_true",
                   help="the worker's --no-hold-batch: batch sequences run beside interactive prefills")
    p.add_argument("--probes", type=int, default=30, help="interactive probes per phase")
    p.add_argument("--probe-max-tokens", type=int, default=8)
    p.add_argument("--probe-gap-s", type=float, default=0.2, help="pause between probes (interactive is sparse)")
    return p.parse_args(argv)


def probe(client: httpx.Client, url: str, i: int, max_tokens: int) -> float:
    """Seconds to the first streamed token of one completion."""
    body = {"model": MODEL, "prompt": [7 + i % 50, 11, 13, 17 + i % 7], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError("a probe streamed no token")


def probes(client: httpx.Client, url: str, args: argparse.Namespace) -> list[float]:
    ttfts = []
    for i in range(args.probes):
        ttfts.append(probe(client, url, i, args.probe_max_tokens))
        time.sleep(args.probe_gap_s)
    return ttfts


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def batch_lines(args: argparse.Namespace) -> bytes:
    lines = [{"custom_id": f"item-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": [3 + i % 200, 5, 8, 13, 21], "max_tokens": args.batch_max_tokens,
                       "ignore_eos": True, "temperature": 0}} for i in range(args.batch_items)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def answered(client: httpx.Client, url: str, batch_id: str) -> tuple[str, int]:
    batch = client.get(f"{url}/v1/batches/{batch_id}").json()
    counts = batch["request_counts"]
    return batch["status"], counts["completed"] + counts["failed"]


def main(argv: list[str] | None = None) -> int:
    from flotilla.fleet.local import FleetConfig, LocalFleet

    args = parse_args(argv)
    model_dir = ensure_checkpoint(Path.home() / ".cache" / "flotilla" / "bench", args.size)
    with tempfile.TemporaryDirectory() as state:
        config = FleetConfig(model_dir=model_dir, state_dir=Path(state), model_name=MODEL, metrics=False,
                             worker_args=["--output-check-interval-s", "0",
                                          *(["--no-hold-batch"] if args.no_hold_batch else [])],
                             gateway_args=["--batch-concurrency-per-tenant", str(args.batch_concurrency)])
        with LocalFleet(config) as fleet, httpx.Client(timeout=120) as client:
            url = fleet.gateway_url
            probes(client, url, argparse.Namespace(**{**vars(args), "probes": 3}))  # warm-up
            alone = probes(client, url, args)

            upload = client.post(f"{url}/v1/files", data={"purpose": "batch"},
                                 files={"file": ("in.jsonl", io.BytesIO(batch_lines(args)))}).json()
            batch = client.post(f"{url}/v1/batches", json={"input_file_id": upload["id"], "completion_window": "24h",
                                                           "endpoint": "/v1/completions"}).json()
            while answered(client, url, batch["id"])[1] < 1:  # the batch is running
                time.sleep(0.05)
            started, (_, before) = time.monotonic(), answered(client, url, batch["id"])
            mixed = probes(client, url, args)
            mixed_s, (_, during) = time.monotonic() - started, answered(client, url, batch["id"])
            while (state_now := answered(client, url, batch["id"]))[0] not in ("completed", "failed", "expired"):
                time.sleep(0.1)
            trough_s = time.monotonic() - started - mixed_s
            final = client.get(f"{url}/v1/batches/{batch['id']}").json()
    line = {"size": args.size, "batch_items": args.batch_items, "batch_max_tokens": args.batch_max_tokens,
            "batch_concurrency": args.batch_concurrency, "hold_batch": not args.no_hold_batch, "probes": args.probes, "loadavg_1m": os.getloadavg()[0],
            "ttft_alone_p50_s": statistics.median(alone), "ttft_alone_p95_s": p95(alone),
            "ttft_mixed_p50_s": statistics.median(mixed), "ttft_mixed_p95_s": p95(mixed),
            "ttft_p95_ratio": p95(mixed) / p95(alone),
            "batch_items_per_s_with_probes": (during - before) / mixed_s,
            "batch_items_per_s_alone": (args.batch_items - during) / trough_s if trough_s > 0 else None,
            "batch_status": state_now[0], "batch_completed": final["request_counts"]["completed"]}
    print(f"TTFT alone p50 {line['ttft_alone_p50_s'] * 1000:.1f} ms p95 {line['ttft_alone_p95_s'] * 1000:.1f} ms; "
          f"with the batch running p50 {line['ttft_mixed_p50_s'] * 1000:.1f} ms p95 "
          f"{line['ttft_mixed_p95_s'] * 1000:.1f} ms (x{line['ttft_p95_ratio']:.2f})")
    print(f"batch: {line['batch_items_per_s_with_probes']:.2f} items/s beside the probes, "
          f"{line['batch_items_per_s_alone'] or 0:.2f} items/s alone; {line['batch_status']}, "
          f"{line['batch_completed']}/{args.batch_items} completed")
    print(json.dumps(line))
    return 0 if line["batch_status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
