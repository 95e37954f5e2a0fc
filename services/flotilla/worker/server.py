"""Worker process wiring: engine thread, gRPC server, router registration, graceful stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.cuda_graphs import GraphCaptureError
from flotilla.engine.engine import LLMEngine
from flotilla.engine.process_engine import ProcessEngine
from flotilla.observability.exposition import serve_metrics
from flotilla.rpc.leases import LeaseVerifier, read_secret
from flotilla.rpc.options import address, aio_server, bind
from flotilla.rpc.serving import announce, stop_on_signals
from flotilla.engine.tokenizer_files import files_digest, read_tokenizer_files
from flotilla.worker.access import WORKER_POLICY
from flotilla.worker.config import WorkerConfig
from flotilla.worker.kv_wiring import attach_kv_transfer, role_proto
from flotilla.worker.output_check import OutputCheck
from flotilla.worker.registration import RouterLinks
from flotilla.worker.service import WorkerService, current_load, model_info
from flotilla.worker.telemetry import WorkerMetrics

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine refused its settings or checkpoint while starting (after the model loaded: a KV budget that holds
    no block, an fp8 cache on a GPU without fp8, a failed graph capture...). `flotilla worker` prints it in one
    line; the traceback is logged at debug level."""


async def serve(
    config: WorkerConfig,
    stop: asyncio.Event | None = None,
    engine_factory: Callable[[], LLMEngine] | None = None,
) -> None:
    """Run a worker until `stop` is set (or SIGTERM/SIGINT when no event is given)."""
    if stop is None:
        stop = asyncio.Event()
        stop_on_signals(stop)
    engine = _engine(config, engine_factory)
    try:
        await engine.start()
    except (ValueError, GraphCaptureError) as error:  # the engine's own refusals; anything else keeps its traceback
        logger.debug("engine start-up failed", exc_info=True)
        raise EngineStartError(str(error)) from error
    worker_id = config.resolved_worker_id()
    # What gateways need to serve the model (tokenizer, templates): published through the router.
    tokenizer_files = read_tokenizer_files(engine.engine.config.model_dir)
    model = model_info(engine, config.resolved_model_name(), files_digest(tokenizer_files))
    metrics = WorkerMetrics()
    metrics.watch_engine(engine.stats, model.name, worker_id)
    server = aio_server(config.tls, WORKER_POLICY)
    worker_service = WorkerService(engine, worker_id, model, metrics)
    if config.lease_secret_file:
        worker_service.leases = LeaseVerifier(read_secret(config.lease_secret_file), worker_id)
    output_check = await _start_output_check(config, engine, metrics)
    worker_service.output_check = output_check
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker_service, server)
    port = bind(server, config.host, config.port, config.tls)
    kv = await attach_kv_transfer(config.disagg, engine, server, worker_service, config.advertise_host or config.host,
                                  port, config.tls)  # fmt: skip
    await server.start()
    link = _router_link(config, worker_id, model, tokenizer_files, port,
                        lambda: _with_check(kv.decorate(current_load(engine)), output_check))
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port, config.metrics_port_file)
    output_check_task = asyncio.create_task(output_check.run_forever()) if output_check is not None else None
    announce("worker", config.host, port, config.port_file)
    engine_exit = asyncio.ensure_future(engine.wait_exited()) if isinstance(engine, ProcessEngine) else None
    try:
        await _until_stopped(stop, engine_exit)
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        # Leave the routers first so that no new work arrives, then let running streams finish.
        logger.info("worker %s stopping", worker_id)
        if link is not None:
            await link.stop()
        if output_check_task is not None:
            output_check_task.cancel()
        await server.stop(config.shutdown_grace_s)
        await kv.close()
        await engine.shutdown()
    if engine_exit is not None and not engine_exit.done():
        engine_exit.cancel()  # a normal stop
    elif engine_exit is not None and engine_exit.result() is not None:
        # Its streams failed over already (the gateway resumes them elsewhere); exiting non-zero lets the
        # supervisor (flotilla up, Kubernetes) start a fresh worker instead of keeping one that cannot serve.
        raise SystemExit(f"flotilla worker: {engine_exit.result()}")


async def _until_stopped(stop: asyncio.Event, engine_exit: asyncio.Future | None) -> None:
    """Until `stop` is set or, with the engine in its own process, that process dies."""
    stopping = asyncio.ensure_future(stop.wait())
    waiting = {stopping} if engine_exit is None else {stopping, engine_exit}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if engine_exit is not None and engine_exit.done() and engine_exit.result() is not None:
        logger.error("the engine process died (%s); the worker stops", engine_exit.result())


def _engine(config: WorkerConfig, engine_factory: Callable[[], LLMEngine] | None) -> AsyncEngine | ProcessEngine:
    if config.engine_process:
        if engine_factory is not None or config.disagg.role != "both":
            raise ValueError("the engine's own process serves role both with the worker's own engine config")
        return ProcessEngine(config.engine, stream_interval_s=config.stream_interval_s)
    return AsyncEngine(engine_factory or (lambda: LLMEngine(config.engine)), stream_interval_s=config.stream_interval_s)


async def _start_output_check(config: WorkerConfig, engine: AsyncEngine, metrics: WorkerMetrics
                              ) -> OutputCheck | None:
    """The golden generation is recorded before the worker registers: what it records is what the weights
    answered at load."""
    if config.output_check.interval_s <= 0:
        return None
    check = OutputCheck(engine, config.output_check, lambda result: metrics.output_checks.labels(result).inc())
    await check.record()
    return check


def _with_check(load: pb.LoadReport, check: OutputCheck | None) -> pb.LoadReport:
    if check is not None:
        load.output_check_failure = check.failure
    return load


def _router_link(
    config: WorkerConfig, worker_id: str, model: pb.ModelInfo, tokenizer_files: Mapping[str, bytes], port: int,
    current_load: Callable[[], pb.LoadReport],
) -> RouterLinks | None:
    if not config.routers:
        return None
    info = rpb.WorkerInfo(
        worker_id=worker_id,
        address=address(config.advertise_host or config.host, port),
        role=role_proto(config.disagg),
        model=model,
        pool=config.pool,
    )
    link = RouterLinks(config.routers, info, current_load, config.heartbeat_interval_s, tokenizer_files, config.tls)
    link.start()
    return link
