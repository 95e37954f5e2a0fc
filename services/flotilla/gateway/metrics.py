"""Prometheus metrics of the gateway; one registry per app so that several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flotilla.observability.latency import LatencyHistograms

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("flotilla_gateway_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("flotilla_gateway_request_seconds",
                                         "Time to the end of the response, by route", ["route"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("flotilla_gateway_ttft_seconds",
                                      "Time from request arrival to the first generated token",
                                      ["model", "tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("flotilla_gateway_tokens", "Tokens metered, by model, tier and kind",
                              ["model", "tier", "kind"], registry=r)
        self.rejections = Counter("flotilla_gateway_rejections", "Requests answered with an error, by reason",
                                  ["reason"], registry=r)
        self.degraded_requests = Counter("flotilla_gateway_degraded_requests",
                                         "Free-tier requests degraded under load (degradation.py), by model and "
                                         "what changed (max_tokens, or only the quota)", ["model", "kind"],
                                         registry=r)
        self.cancellations = Counter("flotilla_gateway_client_cancellations",
                                     "Requests whose client went away before the end", registry=r)
        self.safety_blocks = Counter("flotilla_gateway_safety_blocks",
                                     "Prompts (stage=input) and answers (stage=output) blocked, by policy and category",
                                     ["stage", "policy", "category"], registry=r)
        self.streams_in_flight = Gauge("flotilla_gateway_streams_in_flight", "Open SSE streams", registry=r)
        # TTFT (the histogram above), TPOT, inter-token and end-to-end latency by model and tier.
        self.latency = LatencyHistograms.create("flotilla_gateway", r, ttft=self.ttft_seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
