"""In one process, with an in-memory span exporter: the gateway, router and worker telemetry objects hand
the trace on through gRPC metadata (as the services do) and build one span tree; the stream timer feeds the
latency histograms."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.outputs import RequestOutput
from flotilla.engine.request import FinishReason
from flotilla.gateway.telemetry import GatewayRequestTelemetry
from flotilla.observability.latency import LatencyHistograms, StreamTimer
from flotilla.observability.propagation import incoming_context
from flotilla.router.metrics import RouterMetrics
from flotilla.observability.tracing import setup_tracing
from flotilla.router.telemetry import RouterRequestTelemetry
from flotilla.rpc.stream_events import Finished, Usage
from flotilla.worker.telemetry import RequestTelemetry, WorkerMetrics


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    setup_tracing("flotilla-test", [SimpleSpanProcessor(exporter)])  # this pytest process's global provider
    return exporter


def _output(token_ids: list[int], finished: bool) -> RequestOutput:
    return RequestOutput("r1", token_ids, "x", finished, FinishReason.LENGTH if finished else None, None, 7, 0,
                         len(token_ids))


def test_one_span_tree_through_metadata(spans: InMemorySpanExporter):
    spans.clear()
    gateway = GatewayRequestTelemetry("r1", "tiny", "free", "acme")
    request = pb.GenerateRequest(request_id="r1", model="tiny", priority=pb.PRIORITY_CLASS_BATCH)
    router = RouterRequestTelemetry(RouterMetrics(), request, "tiny", gateway.outgoing_metadata())
    assert router.tier == "free"
    worker = RequestTelemetry(WorkerMetrics(), "tiny", "w0", "r1", router.outgoing_metadata())
    worker.on_output(_output([5], False))
    worker.on_output(_output([6, 7], True))
    worker.finish("length")
    router.on_result(Finished(FinishReason.LENGTH, Usage(7, 3, 0)))
    router.finish()
    gateway.outcome = "length"
    gateway.finish(worker.timer, 7)
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"gateway.generate", "router.generate", "router.queue_wait", "worker.generate",
                             "worker.prefill", "worker.decode"}
    assert len({s.context.trace_id for s in finished.values()}) == 1
    parents = {name: s.parent.span_id if s.parent else None for name, s in finished.items()}
    ids = {name: s.context.span_id for name, s in finished.items()}
    assert parents == {"gateway.generate": None, "router.generate": ids["gateway.generate"],
                       "router.queue_wait": ids["router.generate"], "worker.generate": ids["router.generate"],
                       "worker.prefill": ids["worker.generate"], "worker.decode": ids["worker.generate"]}
    assert finished["router.generate"].attributes["flotilla.outcome"] == "ok"
    assert finished["worker.generate"].attributes["flotilla.output_tokens"] == 3


def test_no_metadata_means_a_new_trace():
    incoming = incoming_context(None)
    assert incoming.tier == "" and incoming.context == {}


def test_stream_timer_observes_ttft_itl_tpot_and_e2e():
    registry = CollectorRegistry()
    histograms = LatencyHistograms.create("flotilla_test", registry)
    now = iter([0.5, 0.7, 1.1, 1.2])  # first token, one more, two in one message, finish
    timer = StreamTimer(histograms, "tiny", "paid", started_at=0.0, clock=lambda: next(now))
    timer.on_tokens(1)
    timer.on_tokens(1)
    timer.on_tokens(2)
    timer.finish()
    labels = {"model": "tiny", "tier": "paid"}

    def sample(name: str) -> float:
        return registry.get_sample_value(name, labels)

    assert sample("flotilla_test_ttft_seconds_sum") == pytest.approx(0.5)
    assert sample("flotilla_test_itl_seconds_count") == 3  # 0.2, then 0.4 shared by two tokens
    assert sample("flotilla_test_itl_seconds_sum") == pytest.approx(0.6)
    assert sample("flotilla_test_tpot_seconds_sum") == pytest.approx((1.1 - 0.5) / 3)
    assert sample("flotilla_test_e2e_seconds_sum") == pytest.approx(1.2)
