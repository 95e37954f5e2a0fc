"""`flotilla usage`: usage per tenant and traffic class (interactive, batch) over a time range, from the ledger
(Redis stream or JSON-lines file). `billable` is input + output at each request's price factor: batch items at
the batch rate, as the tenant's token quota was charged."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

DEFAULT_USAGE_LOG = ".flotilla/usage.jsonl"  # where `flotilla up` writes it without Redis


def register(subparsers: argparse._SubParsersAction) -> None:
    usage = subparsers.add_parser("usage", help="sum billed tokens per tenant, interactive and batch apart, over a "
                                                 "time range (usage ledger)")
    source = usage.add_mutually_exclusive_group()
    source.add_argument("--redis-url", default=os.environ.get("FLOTILLA_REDIS_URL") or None,
                        help="read the ledger's Redis stream (default $FLOTILLA_REDIS_URL)")
    source.add_argument("--file", default=None, help=f"read a JSON-lines ledger (default {DEFAULT_USAGE_LOG})")
    usage.add_argument("--since", default=None, help="start: ISO time, unix seconds, or an age like 24h, 30m")
    usage.add_argument("--until", default=None, help="end (exclusive), same forms; default now")
    usage.add_argument("--tenant", default=None, help="only this tenant")
    usage.add_argument("--json", action="store_true", help="one JSON object per tenant and traffic class")
    usage.set_defaults(func=_run)


def parse_time(text: str | None, default: float, now: float | None = None) -> float:
    """ISO 8601 (naive = UTC), unix seconds, or an age before now: 90s, 30m, 24h, 7d."""
    if text is None:
        return default
    now = time.time() if now is None else now
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return now - float(text[:-1]) * units[text[-1]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise SystemExit(f"bad time {text!r}: use ISO 8601, unix seconds or an age like 24h") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _records(args: argparse.Namespace, since: float, until: float):
    """One record per request that ended (or, gateway gone, was last checkpointed) in [since, until). Read to the
    end of the ledger: a request checkpointed inside the range but finished after it is billed in the later range,
    by its final record, not in both."""
    from flotilla.usage.sinks import read_file, read_redis
    from flotilla.usage.summary import unique

    if args.redis_url and not args.file:
        import redis

        with redis.Redis.from_url(args.redis_url) as client:
            records = list(read_redis(client, since))
    else:
        records = list(read_file(args.file or DEFAULT_USAGE_LOG, since))
    return [record for record in unique(records) if record.finished_at < until]


def _run(args: argparse.Namespace) -> int:
    from flotilla.usage.summary import per_tenant

    since, until = parse_time(args.since, 0.0), parse_time(args.until, float("inf"))
    if since >= until:
        raise SystemExit("--since must be before --until")
    totals = per_tenant(_records(args, since, until), args.tenant)
    if args.json:
        for t in totals:
            sys.stdout.write(json.dumps(t.__dict__) + "\n")
        return 0
    sys.stdout.write(f"{'tenant':<24} {'class':<11} {'requests':>9} {'ok':>7} {'input':>12} {'cached':>12} "
                     f"{'output':>12} {'billable':>12}\n")
    for t in totals:
        sys.stdout.write(f"{t.tenant:<24} {t.traffic_class:<11} {t.num_requests:>9} {t.num_ok:>7} "
                         f"{t.input_tokens:>12} {t.cached_input_tokens:>12} {t.output_tokens:>12} "
                         f"{t.billable_tokens:>12}\n")
    return 0
