"""KV transfer metrics between prefill and decode workers. Defined here so that dashboards and alerts can
refer to them now; the disaggregation work observes them (bytes and seconds per transfer and direction)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from flotilla.observability.buckets import BYTES_BUCKETS, LATENCY_BUCKETS


@dataclass
class KVTransferMetrics:
    bytes_total: Counter
    transfer_bytes: Histogram
    transfer_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> KVTransferMetrics:
        labels = ["model", "direction"]  # direction: send (prefill side) or receive (decode side)
        return cls(
            bytes_total=Counter("flotilla_kv_transfer_bytes", "KV bytes moved between workers", labels,
                                registry=registry),
            transfer_bytes=Histogram("flotilla_kv_transfer_request_bytes", "KV bytes moved per request", labels,
                                     buckets=BYTES_BUCKETS, registry=registry),
            transfer_seconds=Histogram("flotilla_kv_transfer_seconds", "Time to move one request's KV blocks",
                                       labels, buckets=LATENCY_BUCKETS, registry=registry),
        )

    def observe(self, model: str, direction: str, num_bytes: int, seconds: float) -> None:
        self.bytes_total.labels(model, direction).inc(num_bytes)
        self.transfer_bytes.labels(model, direction).observe(num_bytes)
        self.transfer_seconds.labels(model, direction).observe(seconds)
