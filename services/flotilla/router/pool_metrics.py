"""Metrics by worker pool (context_pools.py), read at scrape time from the registry and the admission queues:
requests waiting per lane, healthy workers and requests in flight per pool. Placements by pool are a counter
in metrics.py (RouterMetrics.placements), counted as they happen."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flotilla.router.admission import Admission
from flotilla.router.context_pools import pool_label
from flotilla.router.registry import WorkerRegistry


class PoolCollector(Collector):
    def __init__(self, registry: WorkerRegistry, admission: Admission):
        self._registry = registry
        self._admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queued = GaugeMetricFamily("flotilla_router_pool_queue_depth", "Requests waiting in the router, by model "
                                   "and the pool they wait for", labels=["model", "pool"])
        for (model, pool), depth in sorted(self._admission.queue_depth_by_pool().items()):
            queued.add_metric([model, pool], depth)
        yield queued
        workers = GaugeMetricFamily("flotilla_router_pool_workers", "Healthy token workers by model and pool",
                                    labels=["model", "pool"])
        inflight = GaugeMetricFamily("flotilla_router_pool_inflight_requests", "Requests placed and not finished, "
                                     "by model, pool and prompt length class (long, short)",
                                     labels=["model", "pool", "prompt"])
        healthy: Counter[tuple[str, str]] = Counter()
        running: Counter[tuple[str, str, str]] = Counter()
        for entry in self._registry.workers():
            if entry.is_fixed_batch:
                continue
            key = (entry.model_name, pool_label(entry.pool))
            healthy[key] += self._registry.is_healthy(entry)
            running[(*key, "long")] += entry.num_long_assigned
            running[(*key, "short")] += max(0, entry.num_assigned - entry.num_long_assigned)
        for key, count in sorted(healthy.items()):
            workers.add_metric(list(key), count)
        for key, count in sorted(running.items()):
            inflight.add_metric(list(key), count)
        yield workers
        yield inflight
