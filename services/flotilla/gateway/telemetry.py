"""Per-request tracing and logging at the gateway: the root span of a request's trace (gateway.request, the
whole HTTP exchange of an API route), the gateway.generate span (the router call, to the last token) whose
context travels to the router in gRPC metadata, and one JSON log record with the timings the client felt."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from starlette.datastructures import Headers
from starlette.types import Scope

from flotilla.engine.request import FinishReason
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.safety.filtered import CONTENT_FILTER_CODE, Filtered
from flotilla.observability.latency import StreamTimer
from flotilla.observability.propagation import Metadata, outgoing_metadata
from flotilla.observability.request_log import log_request
from flotilla.observability.tracing import trace_id_hex, tracer
from flotilla.rpc.stream_events import Finished, StreamEvent


TRACED_PATH_PREFIX = "/v1/"  # API routes only: health checks and Prometheus scrapes make no traces


@contextlib.contextmanager
def http_request_span(scope: Scope, request_id: str) -> Iterator[trace.Span | None]:
    """The current span for one HTTP request (None for untraced paths); the caller sets its status. A caller's
    W3C `traceparent` header makes it a child of the caller's span."""
    if not scope["path"].startswith(TRACED_PATH_PREFIX):
        yield None
        return
    parent = propagate.extract(Headers(scope=scope))
    span = tracer().start_span("gateway.request", context=parent, kind=trace.SpanKind.SERVER,
                               attributes={"http.request.method": scope["method"], "url.path": scope["path"],
                                           "flotilla.request_id": request_id})
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    finally:
        span.end()
        otel_context.detach(token)


class GatewayRequestTelemetry:
    """Construct when the request goes to the router (under the request's span); set `outcome`; finish(timer)
    once at the end. As a tap on the router stream (generation.RouterEvents), with the request's timer: the
    outcome comes from the events and the end, and the end finishes it."""

    def __init__(self, request_id: str, model: str, tier: str, tenant: str, timer: StreamTimer | None = None,
                 num_prompt_tokens: int = 0):
        self._request_id = request_id
        self._model = model
        self._tier = tier
        self._tenant = tenant
        self._timer = timer
        self._num_prompt_tokens = num_prompt_tokens
        self.outcome = "cancelled"  # until the stream ends or fails
        self.span = tracer().start_span("gateway.generate", kind=trace.SpanKind.CLIENT,
                                        attributes={"flotilla.request_id": request_id, "flotilla.model": model,
                                                    "flotilla.tier": tier, "flotilla.tenant": tenant})

    def outgoing_metadata(self) -> Metadata:
        return outgoing_metadata(trace.set_span_in_context(self.span), self._tier)

    def on_event(self, event: StreamEvent) -> None:
        if type(event) is Finished and event.reason is not FinishReason.ABORT:  # an abort ends as an error
            self.outcome = event.reason.value
        elif type(event) is Filtered:
            self.outcome = CONTENT_FILTER_CODE

    def on_end(self, error: GatewayError | None) -> None:
        if error is not None:
            self.outcome = error.code or error.kind.name.lower()
        if self._timer is not None:
            self.finish(self._timer, self._num_prompt_tokens)

    def finish(self, timer: StreamTimer, num_prompt_tokens: int) -> None:
        self.span.set_attribute("flotilla.outcome", self.outcome)
        self.span.set_attribute("flotilla.output_tokens", timer.num_output_tokens)
        self.span.end()
        tpot = None
        if timer.num_output_tokens > 1 and timer.first_token_at is not None:
            tpot = (timer.last_token_at - timer.first_token_at) / (timer.num_output_tokens - 1)
        log_request("gateway", self._request_id, trace_id=trace_id_hex(self.span), model=self._model,
                    tier=self._tier, tenant=self._tenant, outcome=self.outcome, prompt_tokens=num_prompt_tokens,
                    output_tokens=timer.num_output_tokens, ttft_s=timer.ttft_s, tpot_s=tpot, e2e_s=timer.e2e_s)
