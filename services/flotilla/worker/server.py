"""Worker process wiring: engine thread, gRPC server, router registration, graceful stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.engine import LLMEngine
from flotilla.observability.exposition import serve_metrics
from flotilla.rpc.options import address, aio_server, bind
from flotilla.rpc.serving import announce, stop_on_signals
from flotilla.worker.config import WorkerConfig
from flotilla.worker.kv_wiring import KVWiring, attach_kv_transfer, role_proto
from flotilla.worker.registration import RouterLink
from flotilla.worker.service import WorkerService, current_load, model_info
from flotilla.worker.telemetry import WorkerMetrics

logger = logging.getLogger(__name__)


async def serve(
    config: WorkerConfig,
    stop: asyncio.Event | None = None,
    engine_factory: Callable[[], LLMEngine] | None = None,
) -> None:
    """Run a worker until `stop` is set (or SIGTERM/SIGINT when no event is given)."""
    if stop is None:
        stop = asyncio.Event()
        stop_on_signals(stop)
    engine = AsyncEngine(engine_factory or (lambda: LLMEngine(config.engine)),
                         stream_interval_s=config.stream_interval_s)
    await engine.start()
    worker_id = config.resolved_worker_id()
    model = model_info(engine, config.resolved_model_name())
    metrics = WorkerMetrics()
    metrics.watch_engine(engine.stats, model.name, worker_id)
    server = aio_server()
    worker_service = WorkerService(engine, worker_id, model, metrics)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker_service, server)
    port = bind(server, config.host, config.port)
    kv = await attach_kv_transfer(config.disagg, engine, server, worker_service, config.advertise_host or config.host,
                                  port)  # fmt: skip
    await server.start()
    link = _router_link(config, worker_id, model, port, engine, kv)
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port, config.metrics_port_file)
    announce("worker", config.host, port, config.port_file)
    try:
        await stop.wait()
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        # Leave the router first so that no new work arrives, then let running streams finish.
        logger.info("worker %s stopping", worker_id)
        if link is not None:
            await link.stop()
        await server.stop(config.shutdown_grace_s)
        await kv.close()
        await engine.shutdown()


def _router_link(
    config: WorkerConfig, worker_id: str, model: pb.ModelInfo, port: int, engine: AsyncEngine, kv: KVWiring
) -> RouterLink | None:
    if not config.router_address:
        return None
    info = rpb.WorkerInfo(
        worker_id=worker_id,
        address=address(config.advertise_host or config.host, port),
        role=role_proto(config.disagg),
        model=model,
    )
    link = RouterLink(config.router_address, info, lambda: kv.decorate(current_load(engine)),
                      config.heartbeat_interval_s)
    link.start()
    return link
