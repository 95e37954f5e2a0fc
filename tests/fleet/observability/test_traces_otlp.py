"""One request through the real fleet processes: its trace, exported over OTLP/HTTP by the gateway, the
router and the worker, is one tree with one trace id; and each process logs one JSON record for it. On the lease
path the gateway's span is the parent of the router's placement (router.acquire) and of the worker's stream."""

from __future__ import annotations

import json

import httpx

from tests.support.fleet import MODEL, Fleet
from tests.support.otlp_receiver import ReceivedSpan
from tests.support.waiting import wait_until

# span -> (service, parent span)
EXPECTED_TREE = {
    "gateway.request": ("flotilla-gateway", None),
    "gateway.generate": ("flotilla-gateway", "gateway.request"),
    "router.acquire": ("flotilla-router", "gateway.generate"),
    "router.queue_wait": ("flotilla-router", "router.acquire"),
    "worker.generate": ("flotilla-worker", "gateway.generate"),
    "worker.prefill": ("flotilla-worker", "worker.generate"),
    "worker.decode": ("flotilla-worker", "worker.generate"),
}


def _one_request(fleet: Fleet) -> str:
    response = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=60.0,
                          headers={"Authorization": f"Bearer {fleet.keys['k-free']}"},
                          json={"model": MODEL, "max_tokens": 5,
                                "messages": [{"role": "user", "content": "trace me"}]})
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def _trace_of(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    roots = [s for s in spans if s.name == "gateway.request" and s.attributes.get("flotilla.request_id") == request_id]
    if len(roots) != 1:
        return []
    return [s for s in spans if s.trace_id == roots[0].trace_id]


def test_one_trace_spans_gateway_router_and_worker(observed_fleet: Fleet):
    request_id = _one_request(observed_fleet)
    complete = observed_fleet.spans.wait_for(
        lambda spans: {s.name for s in _trace_of(spans, request_id)} >= set(EXPECTED_TREE), timeout_s=30.0)
    spans = _trace_of(observed_fleet.spans.spans, request_id)
    assert complete, sorted((s.service, s.name) for s in spans)
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans) == len(EXPECTED_TREE), [s.name for s in spans]
    for name, (service, parent) in EXPECTED_TREE.items():
        span = by_name[name]
        assert span.service == service, (name, span.service)
        assert span.parent_span_id == (by_name[parent].span_id if parent else ""), name
    assert 1 <= by_name["worker.generate"].attributes["flotilla.output_tokens"] <= 5
    assert by_name["router.acquire"].attributes["flotilla.outcome"] == "ok"  # from the gateway's lease report


def test_each_process_logs_one_json_record_per_request(observed_fleet: Fleet):
    request_id = _one_request(observed_fleet)
    logs = observed_fleet.state_dir / "logs"
    records = {}
    for service in ("gateway", "router", "worker-0"):
        # Each process logs when its own part ends, which may be a moment after the client got its answer.
        lines = wait_until(lambda: [line for line in (logs / f"{service}.log").read_text().splitlines()
                                    if request_id in line], 10, f"{service} to log request {request_id}",
                           interval_s=0.05)
        assert len(lines) == 1, (service, lines)
        records[service] = json.loads(lines[0])
    trace_ids = {r["trace_id"] for r in records.values()}
    assert len(trace_ids) == 1 and len(trace_ids.pop()) == 32
    gateway, router, worker = records["gateway"], records["router"], records["worker-0"]
    assert gateway["outcome"] in ("length", "stop") and gateway["tier"] == "free"
    assert gateway["output_tokens"] == worker["output_tokens"] and 1 <= gateway["output_tokens"] <= 5
    assert gateway["ttft_s"] <= gateway["e2e_s"]
    assert router["queue_wait_s"] >= 0 and router["outcome"] == "ok" and router["worker_id"] == "worker-0"
    assert worker["prefill_s"] + worker["decode_s"] == worker["e2e_s"] or abs(
        worker["prefill_s"] + worker["decode_s"] - worker["e2e_s"]) < 1e-3

