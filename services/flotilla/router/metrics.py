"""Router metrics: requests and rejections by reason, queue wait and depth by model and priority class,
requests in flight on workers, placements by pool (pool_metrics.py has the rest by pool); model lifecycle: route changes, each version's share of traffic and its
outcomes, TTFT, TPOT and output length (version_stats.py keeps the same samples for `flotilla models status`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.observability.buckets import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS
from flotilla.router.models import Route
from flotilla.router.version_stats import VersionStats

OUTPUT_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


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
        self.placements = Counter("flotilla_router_placements", "Requests placed on a worker, by model, the "
                                  "worker's pool and the prompt's length class (long: over the model's long-context "
                                  "threshold)", ["model", "pool", "prompt"], registry=r)
        self.inflight = Gauge("flotilla_router_inflight_requests", "Requests placed on a worker and not finished",
                              ["model"], registry=r)
        self.route_changes = Counter("flotilla_router_model_route_changes", "Model registry changes (adopt, "
                                     "alias, rollout, promote, rollback) by model", ["model", "action"], registry=r)
        self.route_weight = Gauge("flotilla_router_model_route_weight_percent", "Share of a model's new "
                                  "conversations each version gets, by role (current, candidate)",
                                  ["model", "version", "role"], registry=r)
        self.version_requests = Counter("flotilla_router_version_requests", "Finished requests by model version "
                                        "and outcome", ["model", "version", "outcome"], registry=r)
        self.version_ttft = Histogram("flotilla_router_version_ttft_seconds", "Arrival to first relayed token, by "
                                      "model version", ["model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.version_tpot = Histogram("flotilla_router_version_tpot_seconds", "Mean time per output token after "
                                      "the first, by model version", ["model", "version"],
                                      buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.version_output_tokens = Histogram("flotilla_router_version_output_tokens", "Output tokens relayed "
                                               "per request, by model version", ["model", "version"],
                                               buckets=OUTPUT_TOKEN_BUCKETS, registry=r)
        self.versions = VersionStats()
        self._weight_labels: dict[str, list[tuple[str, str, str]]] = {}
        self._children: dict[tuple, object] = {}  # (metric, labels) -> its child (child())

    def child(self, metric, *labels: str):
        """metric.labels(*labels), kept: labels() takes a lock and builds its key on every call, and every request
        calls it about ten times. Only for metrics whose children are never removed (not route_weight)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def route_changed(self, action: str, name: str, route: Route | None) -> None:
        """A ModelRoutes listener: count the change and set the model's weight gauges."""
        if action != "load":
            self.route_changes.labels(name, action).inc()
        if route is None:
            return
        for labels in self._weight_labels.pop(name, []):
            self.route_weight.remove(*labels)
        split = [(route.current, "current", 100.0 - (route.candidate_percent if route.candidate else 0.0))]
        if route.candidate:
            split.append((route.candidate, "candidate", route.candidate_percent))
        self._weight_labels[name] = [(name, version, role) for version, role, _ in split]
        for version, role, percent in split:
            self.route_weight.labels(name, version, role).set(percent)

    def version_finished(self, name: str, version: str, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         num_output_tokens: int) -> None:
        self.versions.finished(name, version, outcome, ttft_s, tpot_s, num_output_tokens)
        self.child(self.version_requests, name, version, outcome).inc()
        if ttft_s is not None:
            self.child(self.version_ttft, name, version).observe(ttft_s)
        if tpot_s is not None:
            self.child(self.version_tpot, name, version).observe(tpot_s)
        self.child(self.version_output_tokens, name, version).observe(num_output_tokens)
