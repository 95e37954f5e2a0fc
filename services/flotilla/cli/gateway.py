"""`flotilla gateway` (run the HTTP gateway) and `flotilla gateway-key` (add an API key to a keys file)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from flotilla.cli.router_flags import add_router_flag, router_addresses
from flotilla.cli.tls_flags import add_tls_flags, internal_tls
from flotilla.gateway.batch_jobs.settings import BatchSettings
from flotilla.gateway.degradation import DegradationPolicy
from flotilla.gateway.settings import DEFAULT_MAX_BODY_BYTES, TOOL_CALL_PARSERS, GatewaySettings


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("gateway", help="run the HTTP gateway (OpenAI- and Anthropic-compatible)")
    add_router_flag(run, "router address (each model's requests go to one router, failing over to the next)",
                    required=True)
    run.add_argument("--stream-path", choices=("auto", "direct", "relay"), default="auto",
                     help="token streams: auto = from the workers under the router's placement leases when it grants "
                          "them, else relayed by the router; direct / relay force one")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8000, help="0: pick a free port and announce it")
    run.add_argument("--port-file", default=None, help="write the bound port here once listening")
    add_tls_flags(run)
    auth = run.add_mutually_exclusive_group(required=True)
    auth.add_argument("--keys-file", type=Path, help="JSON keys file (see `flotilla gateway-key`)")
    auth.add_argument("--no-auth", action="store_true", help="accept every request (local runs only)")
    auth.add_argument("--redis-url", help="keys and quotas in Redis, shared by every gateway (`flotilla keys`)")
    run.add_argument("--redis-fail-mode", choices=("open", "closed"), default="closed",
                     help="Redis down: closed = 503; open = go on with remembered keys and per-process limits")
    for flag, default, what in (("--wait-budget-paid-s", 30.0, "paid interactive"),
                                ("--wait-budget-free-s", 5.0, "free interactive"),
                                ("--wait-budget-batch-s", 2.0, "batch")):
        run.add_argument(flag, type=float, default=default,
                         help=f"{what}: longest estimated queue wait before 529 (default {default:g})")
    _add_degradation_flags(run)
    run.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    run.add_argument("--default-model", help="model used when a request names none")
    run.add_argument("--model-refresh-s", type=float, default=10.0, help="model list refresh period")
    run.add_argument("--usage-log", type=Path, default=None,
                     help="usage ledger as a JSON-lines file when there is no --redis-url (default: off)")
    run.add_argument("--usage-checkpoint-s", type=float, default=1.0,
                     help="a running stream leaves a usage checkpoint this often: a gateway that dies mid-stream "
                          "bills what it delivered up to its last checkpoint")
    run.add_argument("--stream-resume-grace-s", type=float, default=30.0,
                     help="how long a resumable stream (x-flotilla-resumable) waits for its client to reconnect")
    run.add_argument("--safety-config", type=Path, default=None,
                     help="JSON file of safety policies (rules, classifier) and the default (default: no screening)")
    run.add_argument("--tool-call-parser", default="auto",
                     choices=TOOL_CALL_PARSERS,
                     help="how models write tool calls (default auto: from each model's chat template)")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus /metrics on this port (0: any free port); default: not served. "
                          "Never on the public port")
    run.add_argument("--metrics-host", default=None, help="address of the metrics listener (default: --host)")
    run.add_argument("--metrics-port-file", default=None, help="write the bound metrics port here")
    hygiene = GatewaySettings()
    for flag, kind, what in (
            ("--keep-alive-s", float, "seconds an idle kept-alive connection stays open"),
            ("--header-timeout-s", float, "seconds a client has to send its request headers"),
            ("--body-timeout-s", float, "seconds a client has, after its headers, to send its body"),
            ("--write-timeout-s", float, "seconds a response may wait for a client that stopped reading"),
            ("--send-buffer-bytes", int, "each connection's kernel send buffer (SO_SNDBUF)"),
            ("--max-header-bytes", int, "largest request line + headers"),
            ("--max-connections", int, "open connections (past it: a bare 503)"),
            ("--max-concurrent-requests", int, "requests in flight (past it: 503 in the dialect's shape)"),
            ("--max-streams-per-key", int, "open streams per API key in this gateway (past it: 429)")):
        default = getattr(hygiene, flag[2:].replace("-", "_"))
        run.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")
    batch = run.add_argument_group("batch jobs (/v1/batches, /v1/messages/batches)")
    batch.add_argument("--batch-state-file", type=Path, default=None,
                       help="SQLite file for jobs, items and files when there is no --redis-url "
                            "(default: in memory, lost at exit)")
    batch.add_argument("--batch-max-file-bytes", type=int, default=BatchSettings.max_file_bytes)
    batch.add_argument("--batch-max-requests", type=int, default=BatchSettings.max_requests)
    batch.add_argument("--batch-concurrency-per-tenant", type=int, default=BatchSettings.concurrency_per_tenant,
                       help="a tenant's batch items in flight at once, over all its jobs")
    batch.add_argument("--batch-completion-window-s", type=float, default=BatchSettings.completion_window_s,
                       help="what completion_window 24h means here (default 86400)")
    batch.add_argument("--batch-lease-ttl-s", type=float, default=BatchSettings.lease_ttl_s,
                       help="a job held by a gateway that died is taken over after this long")
    for tier in ("paid", "free"):
        default = getattr(BatchSettings, f"price_factor_{tier}")
        batch.add_argument(f"--batch-price-factor-{tier}", type=float, default=default,
                           help=f"the batch rate of {tier}-tier tenants: a batch item's tokens count against the "
                                f"token quota and as billable tokens times this (default {default:g}, OpenAI's "
                                "batch discount)")
    run.set_defaults(func=_run)

    key = subparsers.add_parser("gateway-key", help="generate an API key and add its digest to a keys file")
    key.add_argument("--keys-file", type=Path, required=True)
    key.add_argument("--key-id", required=True)
    key.add_argument("--tenant", required=True)
    key.add_argument("--tier", choices=("paid", "free"), default="paid")
    key.add_argument("--safety-policy", default="",
                     help="a policy of the gateway's --safety-config (default: its default)")
    key.set_defaults(func=_add_key)


def _add_degradation_flags(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("degradation before refusal (free tier, while the router's queue is long)")
    group.add_argument("--no-degradation", action="store_true",
                       help="never degrade: overload only sheds (529) by the wait budgets")
    for flag, kind, default, what in (
            ("--degrade-onset-s", float, DegradationPolicy.onset_s,
             "estimated interactive queue wait from which free-tier requests are degraded"),
            ("--degrade-free-max-tokens", int, DegradationPolicy.free_max_tokens,
             "a degraded free-tier request's max_tokens at most"),
            ("--degrade-min-quota-fraction", float, DegradationPolicy.min_free_quota_fraction,
             "free-tier tokens-per-minute limits at the free wait budget, as a fraction (linear from the onset)"),
            ("--queue-load-interval-s", float, DegradationPolicy.poll_interval_s,
             "how often the router's queue load is read")):
        group.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")


def degradation_policy(args: argparse.Namespace) -> DegradationPolicy:
    return DegradationPolicy(not args.no_degradation, args.degrade_onset_s, args.degrade_free_max_tokens,
                             args.degrade_min_quota_fraction, args.queue_load_interval_s)


def _run(args: argparse.Namespace) -> int:
    from flotilla.gateway.server import run
    from flotilla.tenancy.admission_policy import AdmissionPolicy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = GatewaySettings(host=args.host, port=args.port, port_file=args.port_file,
                               router_addresses=router_addresses(args.router),
                               keys_file=None if args.no_auth else args.keys_file,
                               max_body_bytes=args.max_body_bytes, default_model=args.default_model,
                               model_refresh_s=args.model_refresh_s, redis_url=args.redis_url,
                               redis_fail_mode=args.redis_fail_mode, usage_log=args.usage_log,
                               usage_checkpoint_s=args.usage_checkpoint_s,
                               stream_resume_grace_s=args.stream_resume_grace_s,
                               tool_call_parser=args.tool_call_parser, safety_config=args.safety_config,
                               router_tls=internal_tls(args, "gateway"), stream_path=args.stream_path,
                               metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                               metrics_port_file=args.metrics_port_file,
                               keep_alive_s=args.keep_alive_s,
                               header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                               write_timeout_s=args.write_timeout_s, send_buffer_bytes=args.send_buffer_bytes,
                               max_header_bytes=args.max_header_bytes, max_connections=args.max_connections,
                               max_concurrent_requests=args.max_concurrent_requests,
                               max_streams_per_key=args.max_streams_per_key,
                               batch=BatchSettings(state_file=args.batch_state_file,
                                                   max_file_bytes=args.batch_max_file_bytes,
                                                   max_requests=args.batch_max_requests,
                                                   concurrency_per_tenant=args.batch_concurrency_per_tenant,
                                                   completion_window_s=args.batch_completion_window_s,
                                                   lease_ttl_s=args.batch_lease_ttl_s,
                                                   price_factor_paid=args.batch_price_factor_paid,
                                                   price_factor_free=args.batch_price_factor_free),
                               admission=AdmissionPolicy(args.wait_budget_paid_s, args.wait_budget_free_s,
                                                         args.wait_budget_batch_s),
                               degradation=degradation_policy(args))
    if args.safety_config is not None:
        from flotilla.gateway.safety.config import SafetyConfig
        from flotilla.gateway.safety.rules import PolicyError

        try:
            SafetyConfig.load(args.safety_config)  # refused here, with its reason, rather than at the first request
        except PolicyError as err:
            print(f"flotilla gateway: {err}", file=sys.stderr)
            return 2
    from flotilla.observability.setup import setup_observability

    setup_observability("flotilla-gateway")
    run(settings)
    return 0


def _add_key(args: argparse.Namespace) -> int:
    from flotilla.tenancy.keys import KeyEntry, KeyStore, generate_key, hash_key, write_keys_file

    entries = KeyStore.from_file(args.keys_file).entries if args.keys_file.exists() else []
    key = generate_key()
    entry = KeyEntry(args.key_id, hash_key(key), args.tenant, args.tier, safety_policy=args.safety_policy)
    write_keys_file(args.keys_file, [*entries, entry])
    # The only time the plaintext exists outside the caller's hands; only its digest is stored.
    sys.stdout.write(key + "\n")
    return 0
