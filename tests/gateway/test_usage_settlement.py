"""A finished request's usage record is in the sink before the client gets the response's last byte (the ledger's
settle path), streamed or not; a checkpoint record opens every request. The sink here is slow on purpose: with
records only queued, the response would come back long before its record is written."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from flotilla.usage.record import STATUS_OK, STATUS_OPEN

from .in_process_gateway import InProcessGateway

SINK_DELAY_S = 0.3


class _SlowSink:
    def __init__(self):
        self._lock = threading.Lock()
        self._written = []

    async def append(self, records) -> None:
        await asyncio.sleep(SINK_DELAY_S)
        with self._lock:
            self._written.extend(records)

    def final(self, request_id: str):
        with self._lock:
            return [r for r in self._written if r.request_id == request_id and r.status != STATUS_OPEN]

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def slow_ledger_gateway(checkpoint_dir, tmp_path_factory):
    sink = _SlowSink()
    gateway = InProcessGateway(checkpoint_dir, tmp_path_factory.mktemp("ledger-keys"), ledger_sink=sink).start()
    yield gateway, sink
    gateway.stop()


def test_a_non_streamed_answer_is_billed_before_it_is_returned(slow_ledger_gateway):
    gateway, sink = slow_ledger_gateway
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.paid_key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    request_id = raw.headers["x-request-id"]
    answer = raw.parse()
    (record,) = sink.final(request_id)  # no waiting: it was written before the answer left
    assert record.status == STATUS_OK and record.output_tokens == answer.usage.completion_tokens


def test_a_stream_is_billed_before_its_last_byte(slow_ledger_gateway):
    gateway, sink = slow_ledger_gateway
    body = {"model": "tiny", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body, timeout=10,
                      headers={"authorization": f"Bearer {gateway.paid_key}"}) as response:
        request_id = response.headers["x-request-id"]
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    (record,) = sink.final(request_id)
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert record.status == STATUS_OK and record.output_tokens == usage["completion_tokens"] > 0
