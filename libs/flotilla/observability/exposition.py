"""A /metrics HTTP endpoint for a process that has no HTTP server of its own (router, worker)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from flotilla.rpc.options import write_port_file

logger = logging.getLogger(__name__)


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, port_file: str | None = None) -> MetricsServer:
    """Serve `registry` on host:port (0 = any free port, written to `port_file` once bound)."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    metrics = MetricsServer(server, thread)
    if port_file:
        write_port_file(port_file, metrics.port)
    logger.info("metrics on http://%s:%d/metrics", host, metrics.port)
    return metrics
