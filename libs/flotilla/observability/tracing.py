"""OpenTelemetry tracing for a service process.

Spans are always made (trace ids reach the logs and the next hop), but exported only when
OTEL_EXPORTER_OTLP_ENDPOINT is set: then over OTLP/HTTP with a batch processor (the standard OTEL_* variables
tune both). Tests may pass extra span processors (an in-memory exporter).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
TRACER_NAME = "flotilla"


def otlp_enabled(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return any(environ.get(var) for var in ENDPOINT_VARS)


def setup_tracing(service_name: str, processors: Sequence[SpanProcessor] = ()) -> TracerProvider:
    """Install this process's global tracer provider (once per process: OpenTelemetry ignores a second)."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    for processor in processors:
        provider.add_span_processor(processor)
    if otlp_enabled():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


_tracer_of_provider: tuple[trace.TracerProvider | None, trace.Tracer | None] = (None, None)


def tracer() -> trace.Tracer:
    """The global provider's tracer: made once per provider, so that one installed later is used, and not per
    call (get_tracer costs a few µs, and a worker starts several spans per request on its event loop)."""
    global _tracer_of_provider
    provider = trace.get_tracer_provider()
    cached_provider, cached = _tracer_of_provider
    if cached is None or provider is not cached_provider:
        cached = provider.get_tracer(TRACER_NAME)
        _tracer_of_provider = (provider, cached)
    return cached


def trace_id_hex(span: trace.Span | None = None) -> str:
    """The 32-hex-digit trace id of `span` (default: the current span), or "" outside any trace."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
