"""`flotilla worker ...` and `flotilla router ...`: run one service as a process (Ctrl-C / SIGTERM stops it)."""

from __future__ import annotations

import argparse
import logging

from flotilla.cli.router_flags import add_router_flag, router_addresses
from flotilla.cli.tls_flags import add_tls_flags, internal_tls
from flotilla.rpc.serving import run_service
from flotilla.worker.check_settings import CheckSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    worker = subparsers.add_parser("worker", help="serve one model checkpoint (WorkerService), or a fixed "
                                                  "run_batch contract (--backend fixed-batch)")
    _add_common(worker)
    worker.add_argument("--backend", choices=("engine", "fixed-batch"), default="engine",
                        help="engine: the token engine (Generate); fixed-batch: run_batch(inputs) -> outputs, "
                             "batched by the router (POST /v1/batch-generate)")
    worker.add_argument("--model-dir", default=None,
                        help="Hugging Face checkpoint directory (required by the engine and the engine run_batch)")
    worker.add_argument("--model-name", default="", help="served name (default: the directory's name)")
    add_router_flag(worker, "router to register with and report load to (every router given)")
    worker.add_argument("--worker-id", default="", help="default: worker-<random>")
    worker.add_argument("--advertise-host", default=None, help="host the router dials (default: --host)")
    worker.add_argument("--device", default="auto", help="auto: cuda when present, else cpu")
    worker.add_argument("--dtype", default="auto",
                        help="auto: float32 on cpu, bfloat16 (float16 for a float16 checkpoint) on cuda")
    worker.add_argument("--kv-cache-dtype", default="auto",
                        help="auto: the model's dtype; float8_e4m3fn or float8_e5m2 halve the KV bytes")
    worker.add_argument("--kv-cache-scales", choices=("auto", "checkpoint", "calibrate", "unit"), default="auto",
                        help="an fp8 cache's per-layer K/V scales: auto (the checkpoint's k_scale/v_scale "
                             "tensors if it has them, else calibrate), checkpoint (its tensors or fail), calibrate "
                             "(measured at start-up over a fixed text) or unit (1.0: values past the format's range "
                             "saturate)")
    worker.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto",
                        help="auto: the Triton kernels on cuda, the torch path (and C decode kernel) on cpu")
    worker.add_argument("--cpu-linear-backend", choices=("auto", "panel", "onednn", "torch"), default="auto",
                        help="auto: float32 linears on cpu through the engine's own matmul with packed weights "
                             "(panel), else oneDNN's; F.linear elsewhere")
    worker.add_argument("--no-keep-freed-host-memory", action="store_true",
                        help="on cpu, let glibc hand memory freed between steps back to the kernel (smaller resident "
                             "size between bursts; each step then faults its activations in again)")
    worker.add_argument("--onednn-primitive-cache-capacity", type=int, default=16, metavar="SHAPES",
                        help="on cpu, matmul shapes each of oneDNN's two primitive caches keeps; 0: oneDNN's default "
                             "(1,024, which grows the resident size by hundreds of MiB)")
    worker.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on cuda")
    worker.add_argument("--no-overlap", action="store_true",
                        help="on cuda, read each step's tokens before scheduling the next (by default the next step "
                             "is scheduled and launched while one runs, and its text made meanwhile)")
    worker.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block (default: 128 on cpu, where the decode kernel reads longer runs "
                             "faster, 16 on cuda)")
    worker.add_argument("--num-kv-blocks", type=int, default=None)
    worker.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    worker.add_argument("--max-num-batched-tokens", type=int, default=2048)
    worker.add_argument("--max-num-seqs", type=int, default=256)
    worker.add_argument("--max-model-len", type=int, default=None)
    worker.add_argument("--target-tpot-ms", default="auto",
                        help="bound the sequences per step so that a step (each sequence's inter-token time) stays "
                             "under this, batch-class sequences waiting first: auto = 50 on cuda, 40 on cpu (the "
                             "tiny model); off or 0 = run up to --max-num-seqs")
    worker.add_argument("--no-hold-batch", action="store_true",
                        help="let batch-class sequences run beside interactive prefills (default: they wait while "
                             "an interactive request waits for or is in its prefill, and are preempted first)")
    worker.add_argument("--hold-batch-max-steps", type=int, default=8,
                        help="at most this many steps in a row hold batch-class sequences back; then one step runs "
                             "them too (a flood of interactive prefills slows the batch tier, it does not stop it)")
    worker.add_argument("--no-prefix-caching", action="store_true")
    worker.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    worker.add_argument("--num-host-kv-blocks", type=int, default=0, help="host blocks for swap preemption")
    worker.add_argument("--seed", type=int, default=0)
    worker.add_argument("--stream-interval-ms", type=float, default=0.0,
                        help="send running streams' tokens together at most this often (several tokens per "
                             "message and SSE event: less CPU per token on every hop, tokens arrive in bursts); "
                             "first and last tokens at once")
    worker.add_argument("--shutdown-grace-s", type=float, default=5.0,
                        help="SIGTERM: running streams may finish this long, then they move to another worker")
    worker.add_argument("--pool", choices=("default", "long-context"), default="default",
                        help="the pool it registers in: long-context takes the prompts over the router's "
                             "--long-context-threshold (size its KV budget and --max-num-batched-tokens for them)")
    worker.add_argument("--lease-secret-file", default=None, metavar="PATH",
                        help="the router's lease secret: serve only streams with a valid placement lease for this "
                             "worker, from its router or from gateways (default: none; only the router may open "
                             "streams)")
    worker.add_argument("--engine-process", action="store_true",
                        help="run the engine in a child process instead of a thread beside the gRPC loop: the two "
                             "stop sharing a GIL, so an engine pinned to its own cores has them to itself (role "
                             "both, one model; off by default)")
    worker.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                        help="both: colocated; prefill/decode: one side of disaggregated serving (KV over NIXL)")
    worker.add_argument("--min-remote-prefill-tokens", type=int, default=32,
                        help="decode role: a shorter uncached prompt remainder is prefilled on the decode worker")
    worker.add_argument("--kv-lease-s", type=float, default=30.0, help="longest a KV hand-off may take")
    worker.add_argument("--kv-write-after-prefill", action="store_true",
                        help="prefill role: one write per layer after the forward pass, not layer by layer")
    worker.add_argument("--output-check-interval-s", type=float, default=CheckSettings.interval_s,
                        help="golden-output health check every this many seconds while idle (0: off); a wrong "
                             "answer takes the worker out of rotation")
    worker.add_argument("--output-check-busy-interval-s", type=float, default=CheckSettings.busy_interval_s,
                        help="the same check's interval while requests run")
    shared = worker.add_argument_group("shared pool (rarely used models, loaded on demand)")
    shared.add_argument("--shared-models", default=None, metavar="NAME=DIR,...",
                        help="serve these checkpoints (comma-separated NAME=DIR or DIR; --model-dir joins them "
                             "first): each is loaded from local disk when a request needs it")
    shared.add_argument("--max-loaded-models", type=int, default=1,
                        help="with --shared-models: models held loaded at once; another one's load unloads the "
                             "least recently used model that has no live stream")
    fixed = worker.add_argument_group("fixed-batch backend")
    fixed.add_argument("--run-batch", default=None, metavar="MODULE:NAME",
                       help="a run_batch(list[str]) -> list[str] callable, or a factory with from_options(BatchOptions) "
                            "(default: the simulated accelerator, flotilla.worker.fixed_batch.simulated:"
                            "SimulatedAccelerator; the engine's: flotilla.worker.fixed_batch.engine_batch:EngineBatch)")
    fixed.add_argument("--max-batch-size", type=int, default=50, help="B: inputs per run_batch call")
    fixed.add_argument("--batch-latency-ms", type=float, default=200.0,
                       help="L: what one call takes (the simulated accelerator sleeps exactly this; the router "
                            "derives its flush wait from it)")
    fixed.add_argument("--max-tokens", type=int, default=16, help="the engine run_batch's greedy output length")
    worker.set_defaults(func=run_worker)

    router = subparsers.add_parser("router", help="place requests on workers and relay their streams")
    _add_common(router)
    router.add_argument("--alias", action="append", default=[], metavar="ALIAS=TARGET",
                        help="initial alias for a model name or name@version (repeatable); change aliases at "
                             "run time with `flotilla models alias`")
    router.add_argument("--model-routes-file", default=None, metavar="PATH",
                        help="keep the model registry (aliases, rollouts, current versions) in this JSON file: "
                             "a restarted router routes as before (default: in memory)")
    rollback = router.add_argument_group("automatic rollback of a rollout (off unless a bound is given)")
    rollback.add_argument("--auto-rollback-error-rate", type=float, default=None, metavar="FRACTION",
                          help="roll back when the candidate's error rate over the window exceeds this (0..1)")
    rollback.add_argument("--auto-rollback-ttft-p95-s", type=float, default=None,
                          help="roll back when the candidate's TTFT p95 over the window exceeds this")
    rollback.add_argument("--auto-rollback-window-s", type=float, default=120.0)
    rollback.add_argument("--auto-rollback-min-requests", type=int, default=20,
                          help="requests the candidate needs in the window before it is judged")
    router.add_argument("--model", action="append", default=[], metavar="NAME",
                        help="model expected to register: its requests wait instead of MODEL_NOT_FOUND")
    router.add_argument("--heartbeat-timeout-s", type=float, default=1.0)
    router.add_argument("--lease-secret-file", default=None, metavar="PATH",
                        help="secret shared with the workers: the router grants placement leases and gateways "
                             "stream from the workers directly (default: none, streams relayed by the router)")
    router.add_argument("--lease-ttl-s", type=float, default=30.0,
                        help="how long a granted lease may wait for its stream to open on the worker")
    router.add_argument("--max-queue-depth", type=int, default=1024)
    router.add_argument("--max-queue-wait-s", type=float, default=30.0)
    router.add_argument("--cold-start-wait-s", type=float, default=None,
                        help="longest a request for a model with no active replica waits for one (its pool "
                             "scaling from zero), then 503 'model is starting' with Retry-After (default: "
                             "--max-queue-wait-s)")
    router.add_argument("--shared-load-timeout-s", type=float, default=600.0,
                        help="longest one load on a shared-pool worker (--shared-models) may take")
    router.add_argument("--max-queued-tokens-per-worker", type=int, default=32_768)
    router.add_argument("--max-requests-per-worker", type=int, default=64)
    router.add_argument("--idle-tenant-extra-slots", type=int, default=1,
                        help="requests a worker may take over --max-requests-per-worker for tenants with nothing "
                             "in flight (their first request starts at once; 0: off)")
    router.add_argument("--batch-min-free-kv-fraction", type=float, default=0.1,
                        help="batch-class requests go only to workers with at least this share of KV blocks free "
                             "(0: off)")
    router.add_argument("--long-context-threshold", action="append", default=[], metavar="[MODEL=]TOKENS",
                        help="prompts over TOKENS go to the model's long-context pool (workers started with --pool "
                             "long-context); a bare TOKENS is the default for every model not named; repeatable "
                             "(default: no threshold, no long prompts)")
    batch = router.add_argument_group("fixed-batch models (workers started with --backend fixed-batch)")
    batch.add_argument("--batch-latency-budget-ms", type=float, default=500.0,
                       help="p95 end-to-end budget; the flush wait T defaults to budget - 2 L")
    batch.add_argument("--batch-max-wait-ms", type=float, default=None,
                       help="T: flush a partial batch once its oldest call waited this long (default: from the budget)")
    batch.add_argument("--batch-max-attempts", type=int, default=3, help="workers one batch may run on")
    batch.add_argument("--batch-call-timeout-s", type=float, default=30.0,
                       help="a RunBatch taking longer counts as a worker failure")
    batch.add_argument("--batch-max-queue-depth", type=int, default=100_000,
                       help="waiting calls per model; beyond: 529 at once")
    router.set_defaults(func=run_router)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: pick a free port and announce it")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on --host:PORT (0: any free port); default off")
    parser.add_argument("--metrics-port-file", default=None, help="write the bound metrics port here")
    add_tls_flags(parser)


def run_worker(args: argparse.Namespace) -> int:
    from flotilla.engine.config import EngineConfig, resolve_target_tpot_s
    from flotilla.worker.config import WorkerConfig
    from flotilla.worker.server import EngineStartError, serve
    from flotilla.worker.kv_settings import DisaggSettings

    from flotilla.cli.up import check_model

    _configure_logging(args.log_level)
    if args.backend == "fixed-batch":
        return run_fixed_batch_worker(args)
    shared = _shared_models(args)
    if not args.model_dir and not shared:
        raise SystemExit("flotilla worker: --model-dir (or --shared-models) is required")
    for _, model_dir in shared or [("", args.model_dir)]:
        check_model(model_dir, "flotilla worker")
    tls = internal_tls(args, "worker")
    try:
        target_tpot_s = resolve_target_tpot_s(args.target_tpot_ms, args.device)
    except ValueError as err:
        raise SystemExit(f"flotilla worker: {err}") from None
    if args.engine_process and (args.role != "both" or shared):
        raise SystemExit("flotilla worker: --engine-process needs --role both and one model (no --shared-models)")
    if args.hold_batch_max_steps < 1:
        raise SystemExit(f"flotilla worker: --hold-batch-max-steps must be >= 1, got {args.hold_batch_max_steps}")
    if args.onednn_primitive_cache_capacity < 0:
        raise SystemExit("flotilla worker: --onednn-primitive-cache-capacity must be >= 0 (0: oneDNN's default), "
                         f"got {args.onednn_primitive_cache_capacity}")
    engine = EngineConfig(
        model_dir=args.model_dir or shared[0][1],
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_scales=args.kv_cache_scales,
        attention_backend=args.attention_backend,
        cpu_linear_backend=args.cpu_linear_backend,
        cuda_graphs=not args.no_cuda_graphs,
        overlap_output_processing=False if args.no_overlap else None,
        keep_freed_host_memory=not args.no_keep_freed_host_memory,
        onednn_primitive_cache_capacity=args.onednn_primitive_cache_capacity or None,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        target_tpot_s=target_tpot_s,
        hold_batch=not args.no_hold_batch,
        hold_batch_max_steps=args.hold_batch_max_steps,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        num_host_kv_blocks=args.num_host_kv_blocks,
        seed=args.seed,
    )
    config = WorkerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        advertise_host=args.advertise_host,
        worker_id=args.worker_id,
        model_name=args.model_name,
        routers=router_addresses(args.router),
        shutdown_grace_s=args.shutdown_grace_s,
        stream_interval_s=args.stream_interval_ms / 1000,
        metrics_port=args.metrics_port,
        metrics_port_file=args.metrics_port_file,
        output_check=CheckSettings(args.output_check_interval_s, args.output_check_busy_interval_s),
        pool="" if args.pool == "default" else args.pool,
        disagg=DisaggSettings(args.role, args.min_remote_prefill_tokens, args.kv_lease_s,
                              layerwise=not args.kv_write_after_prefill),
        tls=tls,
        shared_models=tuple(shared),
        max_loaded_models=args.max_loaded_models,
        lease_secret_file=args.lease_secret_file,
        engine_process=args.engine_process,
    )
    from flotilla.observability.setup import setup_observability

    setup_observability("flotilla-worker")
    if shared:
        from flotilla.worker.shared_server import serve_shared

        run_service(serve_shared(config))
    else:
        try:
            run_service(serve(config))
        except EngineStartError as err:
            raise SystemExit(f"flotilla worker: {err}") from None
    return 0


def _shared_models(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, dir) of a shared-pool worker's models ([] for a one-model worker); exits on bad flags."""
    if not args.shared_models:
        return []
    from pathlib import Path

    from flotilla.worker.shared_catalog import parse_shared_models

    if args.role != "both" or args.max_loaded_models < 1:
        raise SystemExit("flotilla worker: --shared-models needs --role both and --max-loaded-models >= 1")
    items = ([f"{args.model_name or Path(args.model_dir).resolve().name}={args.model_dir}"] if args.model_dir
             else [])
    try:
        return parse_shared_models(",".join([*items, args.shared_models]))
    except ValueError as err:
        raise SystemExit(f"flotilla worker: {err}") from None


def run_fixed_batch_worker(args: argparse.Namespace) -> int:
    from flotilla.worker.fixed_batch.contract import ENGINE, SIMULATED, BatchOptions
    from flotilla.worker.fixed_batch.server import FixedBatchConfig, serve

    run_batch = args.run_batch or SIMULATED
    if run_batch == ENGINE and not args.model_dir:
        raise SystemExit("flotilla worker: the engine run_batch needs --model-dir")
    try:
        config = FixedBatchConfig(
            model_name=args.model_name, run_batch=run_batch,
            options=BatchOptions(args.max_batch_size, args.batch_latency_ms, args.model_dir, args.max_tokens,
                                 args.device),
            host=args.host, port=args.port, port_file=args.port_file, advertise_host=args.advertise_host,
            worker_id=args.worker_id, routers=router_addresses(args.router), shutdown_grace_s=args.shutdown_grace_s,
            tls=internal_tls(args, "worker"))
    except ValueError as err:
        raise SystemExit(f"flotilla worker: {err}") from None
    run_service(serve(config))
    return 0


def run_router(args: argparse.Namespace) -> int:
    from flotilla.router.batch_dispatcher import BatchSettings
    from flotilla.router.config import RouterConfig
    from flotilla.router.placement import PlacementLimits
    from flotilla.router.server import serve

    _configure_logging(args.log_level)
    config = RouterConfig(
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        aliases=parse_aliases(args.alias),
        model_routes_file=args.model_routes_file,
        auto_rollback=_auto_rollback_rule(args),
        model_names=tuple(args.model),
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        max_queue_depth=args.max_queue_depth,
        max_queue_wait_s=args.max_queue_wait_s,
        cold_start_wait_s=args.cold_start_wait_s,
        shared_load_timeout_s=args.shared_load_timeout_s,
        limits=PlacementLimits(args.max_queued_tokens_per_worker, args.max_requests_per_worker,
                               args.idle_tenant_extra_slots, args.batch_min_free_kv_fraction,
                               _context_thresholds(args.long_context_threshold)),
        batch=BatchSettings(args.batch_latency_budget_ms, args.batch_max_wait_ms, args.batch_max_attempts,
                            args.batch_call_timeout_s, args.batch_max_queue_depth, args.max_queue_wait_s),
        metrics_port=args.metrics_port,
        metrics_port_file=args.metrics_port_file,
        tls=internal_tls(args, "router"),
        lease_secret_file=args.lease_secret_file,
        lease_ttl_s=args.lease_ttl_s,
    )
    from flotilla.observability.setup import setup_observability

    setup_observability("flotilla-router")
    run_service(serve(config))
    return 0


def _auto_rollback_rule(args: argparse.Namespace):
    from flotilla.router.auto_rollback import AutoRollbackRule

    try:
        return AutoRollbackRule(args.auto_rollback_error_rate, args.auto_rollback_ttft_p95_s,
                                args.auto_rollback_window_s, args.auto_rollback_min_requests)
    except ValueError as err:
        raise SystemExit(f"flotilla router: {err}") from None


def _context_thresholds(items: list[str]):
    from flotilla.router.context_pools import ContextThresholds

    try:
        return ContextThresholds.parse(items)
    except ValueError as err:
        raise SystemExit(f"flotilla router: --long-context-threshold: {err}") from None


def parse_aliases(items: list[str]) -> dict[str, str]:
    aliases = {}
    for item in items:
        alias, sep, target = item.partition("=")
        if not sep or not alias or not target:
            raise SystemExit(f"--alias expects ALIAS=TARGET, got {item!r}")
        aliases[alias] = target
    return aliases


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
