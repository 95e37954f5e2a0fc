"""Engine load figures (EngineStats) as Prometheus metrics, read at scrape time: no engine hook, no thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flotilla.engine.outputs import EngineStats

LABELS = ["model", "worker_id"]


class EngineStatsCollector(Collector):
    """`stats` returns the engine's latest EngineStats, or None before the engine has started."""

    def __init__(self, stats: Callable[[], EngineStats | None], model: str, worker_id: str):
        self._stats = stats
        self._labels = [model, worker_id]

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        used = stats.num_total_blocks - stats.num_free_blocks
        gauges = {
            "flotilla_worker_running_requests": ("Requests in the running batch", stats.num_running),
            "flotilla_worker_waiting_requests": ("Requests waiting in the engine", stats.num_waiting),
            "flotilla_worker_queued_tokens": ("Tokens known but not yet computed", stats.num_queued_tokens),
            "flotilla_worker_kv_blocks_free": ("Free KV blocks", stats.num_free_blocks),
            "flotilla_worker_kv_blocks_used": ("KV blocks in use", used),
            "flotilla_worker_kv_blocks_total": ("KV blocks in the pool", stats.num_total_blocks),
            "flotilla_worker_kv_usage_ratio": ("Share of KV blocks in use", used / max(1, stats.num_total_blocks)),
            "flotilla_worker_prefix_cache_hit_rate": ("Prefix-cache hit rate", stats.prefix_hit_rate),
            "flotilla_worker_batch_size": ("Requests in the last step (running batch)", stats.num_running),
            "flotilla_worker_step_tokens": ("Tokens computed in the last step", stats.last_step_num_tokens),
            "flotilla_worker_step_seconds": ("Duration of the last step", stats.last_step_seconds),
            "flotilla_worker_step_seq_limit": ("Sequences a step may run now (the batch bound's cap, else "
                                               "max_num_seqs)", stats.seq_limit),
        }
        for name, (doc, value) in gauges.items():
            yield self._gauge(name, doc, value)
        counters = {
            "flotilla_worker_preemptions": ("Preemptions since start", stats.num_preemptions),
            "flotilla_worker_prompt_tokens": ("Prompt tokens computed since start", stats.num_prompt_tokens_total),
            "flotilla_worker_output_tokens": ("Output tokens generated since start", stats.num_output_tokens_total),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self._labels, value)
            yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked: names do not clash, and describing would need an engine
