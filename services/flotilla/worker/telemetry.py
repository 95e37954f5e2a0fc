"""Worker metrics and per-request tracing: the latency histograms, engine load figures read from stats(),
and for each Generate call a span tree (worker.generate > worker.prefill, worker.decode, and on a decode worker
that received the prompt's KV from a prefill worker, worker.kv_transfer) plus one JSON log record. The prefill span runs from submission to the first token, so it includes any wait in the engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter

from flotilla.engine.outputs import EngineStats, RequestOutput
from flotilla.observability.engine_collector import EngineStatsCollector
from flotilla.observability.kv_transfer import KVTransferMetrics
from flotilla.observability.latency import LatencyHistograms, StreamTimer
from flotilla.observability.propagation import incoming_context
from flotilla.observability.request_log import log_request
from flotilla.observability.tracing import trace_id_hex, tracer


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.latency = LatencyHistograms.create("flotilla_worker", self.registry)
        self.requests = Counter("flotilla_worker_requests", "Generate calls by model, tier and outcome",
                                ["model", "tier", "outcome"], registry=self.registry)
        self.kv_transfer = KVTransferMetrics.create(self.registry)
        self.output_checks = Counter("flotilla_worker_output_checks", "Golden-output checks by result "
                                     "(pass, fail, timeout)", ["result"], registry=self.registry)

    def watch_engine(self, stats: Callable[[], EngineStats | None], model: str, worker_id: str) -> None:
        self.registry.register(EngineStatsCollector(stats, model, worker_id))


class RequestTelemetry:
    """One Generate call. `finish(outcome)` must run once, whatever happened (a finally block)."""

    def __init__(self, metrics: WorkerMetrics, model: str, worker_id: str, request_id: str,
                 metadata: Iterable[tuple[str, str | bytes]] | None):
        incoming = incoming_context(metadata)
        self._metrics = metrics
        self._model = model
        self._worker_id = worker_id
        self._request_id = request_id
        self.timer = StreamTimer(metrics.latency, model, incoming.tier or "unknown", time.perf_counter())
        self.span = tracer().start_span("worker.generate", context=incoming.context, kind=trace.SpanKind.SERVER,
                                        attributes={"flotilla.request_id": request_id,
                                                    "flotilla.worker_id": worker_id, "flotilla.model": model})
        parent = trace.set_span_in_context(self.span)
        self._prefill = tracer().start_span("worker.prefill", context=parent)
        self._decode: trace.Span | None = None
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0

    def kv_transfer_span(self) -> trace.Span:
        """A child of worker.generate for one KV hand-off; the caller ends it."""
        return tracer().start_span("worker.kv_transfer", context=trace.set_span_in_context(self.span))

    def on_output(self, output: RequestOutput) -> None:
        self._num_prompt_tokens = output.num_prompt_tokens
        self._num_cached_tokens = output.num_cached_prompt_tokens
        if output.new_token_ids and self._decode is None:
            self._prefill.set_attributes({"flotilla.prompt_tokens": output.num_prompt_tokens,
                                          "flotilla.cached_prompt_tokens": output.num_cached_prompt_tokens})
            self._prefill.end()
            self._decode = tracer().start_span("worker.decode", context=trace.set_span_in_context(self.span))
        self.timer.on_tokens(len(output.new_token_ids))

    def finish(self, outcome: str) -> None:
        self.timer.finish()
        for span in (self._prefill, self._decode):
            if span is not None and span.is_recording():
                span.end()
        self.span.set_attribute("flotilla.outcome", outcome)
        self.span.set_attribute("flotilla.output_tokens", self.timer.num_output_tokens)
        self.span.end()
        self._metrics.requests.labels(self._model, self.timer.tier, outcome).inc()
        ttft, e2e = self.timer.ttft_s, self.timer.e2e_s
        log_request("worker", self._request_id, trace_id=trace_id_hex(self.span), worker_id=self._worker_id,
                    model=self._model, tier=self.timer.tier, outcome=outcome,
                    prompt_tokens=self._num_prompt_tokens, cached_prompt_tokens=self._num_cached_tokens,
                    output_tokens=self.timer.num_output_tokens, prefill_s=ttft,
                    decode_s=None if ttft is None or e2e is None else e2e - ttft, e2e_s=e2e)
