"""The batch runner's Prometheus metrics, on the gateway's registry (its /metrics page)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.results = Counter("flotilla_gateway_batch_items", "Batch-job items given their result, by result type "
                               "(succeeded, errored, canceled, expired)", ["result"], registry=r)
        self.retries = Counter("flotilla_gateway_batch_item_retries", "Batch-job item calls answered 'later' and "
                               "run again, by HTTP status", ["status"], registry=r)
        self.in_flight = Gauge("flotilla_gateway_batch_items_in_flight", "Batch-job items running in this gateway",
                               registry=r)
