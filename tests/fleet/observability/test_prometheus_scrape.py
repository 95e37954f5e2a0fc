"""A real Prometheus server scrapes the running fleet (gateway, router, worker /metrics) and answers PromQL
with the number of requests this test sent."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.fleet import MODEL, Fleet

from .prometheus_server import PrometheusServer

NUM_REQUESTS = 5


def _send(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.keys["k-paid"], max_retries=0)
    for i in range(NUM_REQUESTS):
        messages = [{"role": "user", "content": f"count to {i}"}]
        if i % 2:
            stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True)
            assert [chunk for chunk in stream]
        else:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)


@pytest.fixture(scope="module")
def prometheus(observed_fleet: Fleet, tmp_path_factory):
    _send(observed_fleet)
    targets = observed_fleet.fleet.metrics_targets()
    assert set(targets) == {"gateway", "router", "worker-0"}, targets
    with PrometheusServer(tmp_path_factory.mktemp("prometheus"), targets) as server:
        yield server


def test_promql_counts_the_requests_sent(prometheus: PrometheusServer):
    # Gateway, worker (tier label carried in gRPC metadata) and router each saw exactly the requests sent.
    queries = [
        'sum(flotilla_gateway_e2e_seconds_count{tier="paid"})',
        'sum(flotilla_gateway_ttft_seconds_count{tier="paid"})',
        'sum(flotilla_worker_e2e_seconds_count{tier="paid"})',
        'sum(flotilla_worker_requests_total{tier="paid", outcome=~"length|stop"})',
        'sum(flotilla_router_requests_total{tier="paid", outcome="ok"})',
    ]
    for promql in queries:
        value = prometheus.wait_for_value(promql, NUM_REQUESTS)
        assert value == NUM_REQUESTS, (promql, value, prometheus.targets_up())


def test_engine_and_router_gauges_are_scraped(prometheus: PrometheusServer):
    assert prometheus.wait_for_value("sum(flotilla_worker_kv_blocks_total)", 128) == 128
    assert prometheus.wait_for_value("sum(flotilla_worker_output_tokens_total) >= bool 5", 1) == 1
    assert prometheus.wait_for_value("sum(flotilla_router_queue_depth)", 0) == 0
    assert set(prometheus.targets_up().values()) == {"up"}


DASHBOARD = Path(__file__).resolve().parents[3] / "charts" / "flotilla" / "dashboards" / "flotilla-slo.json"
NOT_EXPORTED_YET = ("flotilla_autoscaler_",)  # set by the autoscaler (AutoscalerMetrics), not by these processes


def test_dashboard_queries_run_and_name_exported_metrics(prometheus: PrometheusServer,
                                                         observed_fleet: Fleet):
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    exposition = "".join(httpx.get(f"http://{target}/metrics", timeout=5.0).text
                         for target in observed_fleet.fleet.metrics_targets().values())
    for expr in exprs:
        prometheus.query(expr.replace("$model", ".*").replace("$__rate_interval", "1m"))  # raises if invalid
        for name in re.findall(r"flotilla_[a-z0-9_]+", expr):
            family = re.sub(r"_(bucket|count|sum|total)$", "", name)
            exported = re.search(rf"^# TYPE {family}(_total)? ", exposition, re.MULTILINE)
            assert name.startswith(NOT_EXPORTED_YET) or exported, (name, expr)
