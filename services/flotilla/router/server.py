"""Router process wiring: gRPC server, the health sweeper, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.router.admission import Admission
from flotilla.router.auto_rollback import AutoRollbackRule, check_rollouts
from flotilla.router.batch_dispatcher import BatchDispatcher
from flotilla.router.config import RouterConfig
from flotilla.router.model_routes import ModelRoutes
from flotilla.router.models import expected_names
from flotilla.router.registry import WorkerRegistry
from flotilla.observability.exposition import serve_metrics
from flotilla.router.pool_metrics import PoolCollector
from flotilla.router.service import RouterService
from flotilla.router.shared_pool import SharedPool, SharedPoolMetrics
from flotilla.router.telemetry import RouterMetrics
from flotilla.router.access import ROUTER_POLICY
from flotilla.rpc.leases import LeaseSigner, read_secret
from flotilla.rpc.options import aio_channel, aio_server, bind
from flotilla.rpc.serving import announce, stop_on_signals

logger = logging.getLogger(__name__)


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Run the router until `stop` is set (or SIGTERM/SIGINT when no event is given)."""
    config.validate()
    if stop is None:
        stop = asyncio.Event()
        stop_on_signals(stop)
    registry = WorkerRegistry(config.heartbeat_timeout_s, config.evict_after_s,
                              channel_factory=lambda address: aio_channel(address, config.tls, "worker"))
    metrics = RouterMetrics()
    routes = ModelRoutes(config.aliases, config.model_routes_file)
    routes.add_listener(lambda change, name, route: metrics.route_changed(change.action, name, route))
    admission = Admission(
        registry,
        routes,
        expected_names(config.model_names, config.aliases),
        config.limits,
        config.max_queue_depth,
        config.max_queue_wait_s,
        cold_start_wait_s=config.cold_start_wait_s,
        shared=SharedPool(registry, SharedPoolMetrics(metrics.registry), config.shared_load_timeout_s),
    )
    batches = BatchDispatcher(registry, config.batch, frozenset(config.model_names))
    leases = (LeaseSigner(read_secret(config.lease_secret_file), config.lease_ttl_s)
              if config.lease_secret_file else None)
    server = aio_server(config.tls, ROUTER_POLICY)
    router_pb2_grpc.add_RouterServiceServicer_to_server(
        RouterService(registry, admission, config.heartbeat_interval_s, metrics, batches, leases),
        server,
    )
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    sweeper = asyncio.create_task(_sweep_forever(registry, config.heartbeat_timeout_s / 4))
    dispatcher = asyncio.create_task(batches.run_forever())
    tasks = [sweeper, dispatcher]
    if config.auto_rollback.enabled:
        tasks.append(asyncio.create_task(_auto_rollback_forever(config.auto_rollback, admission, metrics, registry)))
    metrics.registry.register(PoolCollector(registry, admission))
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port, config.metrics_port_file)
    announce("router", config.host, port, config.port_file)
    try:
        await stop.wait()
    finally:
        logger.info("router stopping")
        if metrics_server is not None:
            metrics_server.stop()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(config.shutdown_grace_s)
        await registry.close()


async def _sweep_forever(registry: WorkerRegistry, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)  # a periodic timer, not a wait for something
        try:
            await registry.sweep()
        except Exception:
            logger.exception("registry sweep failed")


async def _auto_rollback_forever(rule: AutoRollbackRule, admission: Admission, metrics: RouterMetrics,
                                 registry: WorkerRegistry, interval_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(interval_s)  # a periodic check, not a wait for something
        try:
            if check_rollouts(rule, admission.routes, metrics.versions, registry.model_versions):
                admission.dispatch()
        except Exception:
            logger.exception("automatic rollback check failed")
