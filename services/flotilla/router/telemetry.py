"""Router metrics and per-request tracing: for each Generate call a span tree (router.generate >
router.queue_wait), the metadata that carries the trace on to the worker, and one JSON log record."""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry import trace

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.observability.propagation import Metadata, incoming_context, outgoing_metadata
from flotilla.observability.request_log import log_request
from flotilla.router.metrics import RouterMetrics, error_reason_label, priority_class_label
from flotilla.observability.tracing import trace_id_hex, tracer
from flotilla.router.admission import Placement
from flotilla.router.context_pools import pool_label
from flotilla.rpc.stream_events import Error, Finished


class RouterRequestTelemetry:
    """One Generate call: construct on arrival, then placed() or failed(), on_result() with the relayed last
    event (or failed() for a call that failed), and finish() once at the end (a finally block)."""

    def __init__(self, metrics: RouterMetrics, request: pb.GenerateRequest, model: str,
                 metadata: Iterable[tuple[str, str | bytes]] | None, span_name: str = "router.generate"):
        """`model`: the resolved model name (the requested one when it does not resolve); `span_name`:
        router.acquire for a lease (lease_service.py)."""
        incoming = incoming_context(metadata)
        self._metrics = metrics
        self._request_id = request.request_id
        self._model = model
        self._class = priority_class_label(request.priority)
        self.tier = incoming.tier
        self._arrived = time.perf_counter()
        self._queue_wait_s: float | None = None
        self._worker_id = ""
        self.outcome = "cancelled"  # until a Finished or an error says otherwise
        self.span = tracer().start_span(span_name, context=incoming.context, kind=trace.SpanKind.SERVER,
                                        attributes={"flotilla.request_id": request.request_id,
                                                    "flotilla.model": request.model, "flotilla.class": self._class})
        self._queue_span = tracer().start_span("router.queue_wait", context=trace.set_span_in_context(self.span))
        self._placed = False
        self._version: tuple[str, str] | None = None  # (name, version) placed on, for per-version stats
        self._num_tokens = 0
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._reported: pb.StreamReport | None = None  # a lease's end, as its holder saw the stream
        metrics.child(metrics.queue_depth, self._model, self._class).inc()

    def placed(self, placement: Placement) -> None:
        self.running_on(placement.worker.worker_id)
        self._end_queue_wait()
        self._placed = True
        self._metrics.child(self._metrics.inflight, self._model).inc()
        self._metrics.child(self._metrics.queue_wait, self._model, self._class).observe(self._queue_wait_s)
        self._metrics.child(self._metrics.placements, self._model, pool_label(placement.worker.pool),
                                        "long" if placement.long_context else "short").inc()
        resolution = placement.resolution
        if resolution.version:
            self._version = (resolution.name, resolution.version)
            self._metrics.versions.started(*self._version)
            self.span.set_attribute("flotilla.model_version", resolution.version)

    def on_tokens(self, num_tokens: int) -> None:
        """Tokens relayed to the caller (for the version's TTFT, TPOT and output length)."""
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
        self._last_token_at = now
        self._num_tokens += num_tokens

    def running_on(self, worker_id: str) -> None:
        """The worker the stream runs on: the plan may move it off admission's choice; failover moves it."""
        self._worker_id = worker_id
        self.span.set_attribute("flotilla.worker_id", worker_id)

    def failed(self, code: int) -> None:
        self._end_queue_wait()
        self.outcome = error_reason_label(code)

    def outgoing_metadata(self) -> Metadata:
        """Trace context (this router's span as parent) and tier for the worker call."""
        return outgoing_metadata(trace.set_span_in_context(self.span), self.tier)

    def on_result(self, event: Finished | Error) -> None:
        self.outcome = "ok" if type(event) is Finished else error_reason_label(event.code)

    def on_report(self, report: pb.StreamReport) -> None:
        """A lease's end as its holder (the gateway) saw the stream: outcome, TTFT, TPOT and tokens."""
        self._reported = report
        if report.worker_lost:
            self.outcome = "worker_lost"
        elif report.error_code:
            self.outcome = error_reason_label(report.error_code)
        else:
            self.outcome = "ok" if report.finished else "cancelled"

    def finish(self) -> None:
        self._end_queue_wait()
        if self._placed:
            self._metrics.child(self._metrics.inflight, self._model).dec()
        report = self._reported
        if report is not None and self._version is not None and not report.worker_lost:
            # A lost lease is not a sample: the request goes on under another one, which reports its outcome.
            self._metrics.version_finished(*self._version, self.outcome, report.ttft_s or None,
                                           report.tpot_s or None, report.num_output_tokens)
        elif report is None and self._version is not None:
            first = self._first_token_at
            ttft = first - self._arrived if first is not None else None
            tpot = (self._last_token_at - first) / (self._num_tokens - 1) if first and self._num_tokens > 1 else None
            self._metrics.version_finished(*self._version, self.outcome, ttft, tpot, self._num_tokens)
        self._metrics.child(self._metrics.requests, self._model, self._class, self.tier or "unknown",
                            self.outcome).inc()
        if self.outcome not in ("ok", "cancelled"):
            self._metrics.child(self._metrics.rejections, self.outcome).inc()
        self.span.set_attribute("flotilla.outcome", self.outcome)
        self.span.end()
        log_request("router", self._request_id, trace_id=trace_id_hex(self.span), model=self._model,
                    priority_class=self._class, tier=self.tier, worker_id=self._worker_id, outcome=self.outcome,
                    queue_wait_s=self._queue_wait_s, e2e_s=time.perf_counter() - self._arrived)

    def _end_queue_wait(self) -> None:
        if self._queue_wait_s is None:
            self._queue_wait_s = time.perf_counter() - self._arrived
            self._queue_span.end()
            self._metrics.child(self._metrics.queue_depth, self._model, self._class).dec()
