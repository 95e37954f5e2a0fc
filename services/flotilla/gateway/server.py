"""Runs the gateway: router pool, key store, app, uvicorn."""

from __future__ import annotations

import logging
import socket

import uvicorn

from flotilla.gateway.app import create_app
from flotilla.gateway.connection_limits import ConcurrencyLimit, deadline_protocol
from flotilla.gateway.batch_jobs.redis_store import RedisBatchStore
from flotilla.gateway.fault_tolerance import FaultTolerance
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.tenancy.keys import KeyStore
from flotilla.gateway.router_pool import RouterPool
from flotilla.gateway.settings import GatewaySettings
from flotilla.tenancy.gatekeeper import FailMode, Gatekeeper, open_gatekeeper

log = logging.getLogger(__name__)


def load_key_store(settings: GatewaySettings) -> KeyStore | None:
    if settings.keys_file is None:
        log.warning("no keys file: authentication is OFF; every caller is the tenant 'anonymous'")
        return None
    return KeyStore.from_file(settings.keys_file)


def load_gatekeeper(settings: GatewaySettings) -> Gatekeeper | None:
    """Keys and quotas in Redis when a URL is set; else the keys file (re-read when it changes) with
    in-process quotas; neither: authentication off."""
    if settings.redis_url:
        return open_gatekeeper(settings.redis_url, None, FailMode(settings.redis_fail_mode))
    if load_key_store(settings) is None:  # also validates the keys file before serving
        return None
    return open_gatekeeper(None, str(settings.keys_file))


def uvicorn_config(app, settings: GatewaySettings, **options) -> uvicorn.Config:
    """uvicorn for the public port: httptools with read deadlines, bounded headers, connections and requests in flight
    (connection_limits.py). `app` is the whole ASGI app, its middlewares installed."""
    guarded = ConcurrencyLimit(app, settings.max_concurrent_requests, settings.retry_after_s)
    return uvicorn.Config(guarded, host=settings.host, port=settings.port, lifespan="on",
                          http=deadline_protocol(settings.header_timeout_s, settings.body_timeout_s,
                                                settings.write_timeout_s, settings.keep_alive_s,
                                                settings.max_header_bytes, settings.send_buffer_bytes),
                          timeout_keep_alive=settings.keep_alive_s,
                          limit_concurrency=settings.max_connections, **options)


async def serve(settings: GatewaySettings, sockets: list[socket.socket] | None = None) -> None:
    """Serve until interrupted; `sockets` lets a caller bind first (port 0, tests)."""
    gatekeeper = load_gatekeeper(settings)
    backend = RouterPool(settings.router_addresses, settings.router_timeout_s, settings.router_tls,
                         stream_path=settings.stream_path)
    tolerance = FaultTolerance.open(settings)  # usage ledger, idempotency, resumable streams
    metrics = GatewayMetrics()
    metrics_server = None
    try:
        batch_store = RedisBatchStore(tolerance.redis) if tolerance.redis is not None else None
        app = create_app(settings, backend, None, metrics=metrics, gatekeeper=gatekeeper, ledger=tolerance.ledger,
                         batch_store=batch_store)
        tolerance.install(app)
        if settings.metrics_port is not None:
            from flotilla.observability.exposition import serve_metrics

            metrics_server = serve_metrics(metrics.registry, settings.metrics_host or settings.host,
                                           settings.metrics_port, settings.metrics_port_file)
        config = uvicorn_config(app, settings, log_level="info", timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve(sockets=sockets)
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        await backend.close()
        await tolerance.close()
        if gatekeeper is not None:
            await gatekeeper.close()


def run(settings: GatewaySettings) -> None:
    """Bind first, so that port 0 works and the port is announced only once it accepts connections."""
    from flotilla.rpc.serving import announce, run_service

    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)
    announce("gateway", settings.host, sock.getsockname()[1], settings.port_file)
    run_service(serve(settings, sockets=[sock]))
