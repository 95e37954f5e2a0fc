"""Router metrics: requests and rejections by reason, queue wait and depth by model and priority class,
requests in flight on workers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.observability.buckets import LATENCY_BUCKETS


def priority_class_label(priority: int) -> str:
    """`interactive` or `batch` (unspecified is interactive, as the engine treats it)."""
    return "batch" if priority == pb.PRIORITY_CLASS_BATCH else "interactive"


def error_reason_label(code: int) -> str:
    """ERROR_CODE_OVERLOADED -> `overloaded`."""
    return pb.ErrorCode.Name(code).removeprefix("ERROR_CODE_").lower() if code in pb.ErrorCode.values() else "unknown"


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("flotilla_router_requests", "Generate calls by model, class, tier and outcome "
                                "(ok, cancelled, or the error reason)", ["model", "class", "tier", "outcome"],
                                registry=r)
        self.rejections = Counter("flotilla_router_rejections", "Requests refused or failed, by reason",
                                  ["reason"], registry=r)
        self.queue_wait = Histogram("flotilla_router_queue_wait_seconds", "Time from arrival to placement on a "
                                    "worker", ["model", "class"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("flotilla_router_queue_depth", "Requests waiting for a worker",
                                 ["model", "class"], registry=r)
        self.inflight = Gauge("flotilla_router_inflight_requests", "Requests placed on a worker and not finished",
                              ["model"], registry=r)
