"""What a service entry point calls once at start: tracing and the per-request JSON log."""

from __future__ import annotations

from flotilla.observability.request_log import configure_request_log
from flotilla.observability.tracing import setup_tracing


def setup_observability(service_name: str) -> None:
    """Tracing (OTLP export only when OTEL_EXPORTER_OTLP_ENDPOINT is set) and the per-request JSON log."""
    setup_tracing(service_name)
    configure_request_log()
