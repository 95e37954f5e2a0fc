"""Batch jobs through the real `openai` and `anthropic` SDKs against the in-process gateway (fake router): the
Files and Batch APIs end to end, Message Batches with results, validation failures, cancel midway (the items in
flight are aborted in the router), expiry with partial results, pagination, and tenant isolation.
The fleet version (real engine, restarts, exactly once) is tests/fleet/e2e/test_batch_jobs.py."""

from __future__ import annotations

import io
import json
import time
from dataclasses import replace

import anthropic
import httpx
import openai
import pytest

from flotilla.api.common.v1 import common_pb2
from flotilla.gateway.batch_jobs.settings import BatchSettings

from tests.support.waiting import wait_until

from .fake_router import NUM_NATURAL_TOKENS, canned_text
from .in_process_gateway import InProcessGateway

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.paid_key, max_retries=0)


@pytest.fixture
def claude(gateway):
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.paid_key, max_retries=0)


def _jsonl(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def _chat_line(custom_id: str, model: str = "tiny", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": MESSAGES, "max_tokens": 20, **body}}


def _wait_batch(client, batch_id: str, statuses=("completed", "failed", "expired", "cancelled"), timeout_s=20.0):
    wait_until(lambda: client.batches.retrieve(batch_id).status in statuses, timeout_s, f"batch {batch_id} ended",
               interval_s=0.05)
    return client.batches.retrieve(batch_id)


def _lines(content) -> list[dict]:
    return [json.loads(line) for line in content.text.splitlines()]


def test_openai_batch_end_to_end(gateway, client):
    lines = [_chat_line(f"ok-{i}", max_tokens=3 + i) for i in range(5)]
    lines.append(_chat_line("bad-temperature", temperature=-1))  # answered 400: an error-file line
    upload = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    assert upload.object == "file" and upload.purpose == "batch" and upload.filename == "in.jsonl"
    assert client.files.retrieve(upload.id).bytes == upload.bytes
    assert _lines(client.files.content(upload.id)) == lines

    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    done = _wait_batch(client, batch.id)
    assert done.status == "completed" and done.completed_at and done.finalizing_at and done.in_progress_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)

    output = _lines(client.files.content(done.output_file_id))
    assert [line["custom_id"] for line in output] == [f"ok-{i}" for i in range(5)]
    for i, line in enumerate(output):
        assert line["response"]["status_code"] == 200 and line["error"] is None
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == canned_text(min(3 + i, NUM_NATURAL_TOKENS))
        sent = gateway.fake.request_by_id(line["response"]["request_id"])
        # The batch class, the owner's tenant.
        assert sent.priority == common_pb2.PRIORITY_CLASS_BATCH and sent.tenant_id == "acme"
    [error] = _lines(client.files.content(done.error_file_id))
    assert error["custom_id"] == "bad-temperature" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "temperature"

    sample = gateway.metrics.registry.get_sample_value
    assert sample("flotilla_gateway_batch_items_total", {"result": "succeeded"}) >= 5
    assert sample("flotilla_gateway_batch_items_total", {"result": "errored"}) >= 1

    deleted = client.files.delete(upload.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_invalid_input_file_fails_the_batch_with_line_errors(client):
    lines = [_chat_line("a"), _chat_line("a"), {"custom_id": "b", "method": "GET", "url": "/v1/completions",
                                                 "body": {}}]
    upload = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = _wait_batch(client, batch.id)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    codes = {(e.line, e.code) for e in failed.errors.data}
    assert codes == {(2, "duplicate_custom_id"), (3, "invalid_method"), (3, "mismatched_endpoint")}


def test_bad_requests_are_400s_in_openais_shape(client):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", _jsonl([_chat_line("a")])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="no lines"):
        client.files.create(file=("in.jsonl", io.BytesIO(b"\n")), purpose="batch")
    upload = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="no file"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_other_tenants_cannot_see_files_or_batches(gateway, client):
    upload = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a")])), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.free_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.files.content(upload.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    assert batch.id not in [b.id for b in other.batches.list()]


def test_list_batches_pages_newest_first(client):
    upload = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a")])), purpose="batch")
    ids = [client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    listed = [b.id for b in client.batches.list(limit=2)]  # auto-pagination follows `after`
    assert listed[:3] == ids[::-1]


def test_cancel_midway_aborts_items_in_flight(gateway, client):
    lines = [_chat_line(f"fast-{i}") for i in range(3)] + [_chat_line(f"hang-{i}", model="hang") for i in range(2)]
    hanging = lambda: [r for r in gateway.fake.requests if r.model == "hang" and r.tenant_id == "acme"]  # noqa: E731
    before = len(hanging())
    upload = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: len(hanging()) >= before + 2 and client.batches.retrieve(batch.id).request_counts.completed
               == 3, 20, "3 items answered and 2 hanging", interval_s=0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert [line["custom_id"] for line in _lines(client.files.content(done.output_file_id))] == \
        [f"fast-{i}" for i in range(3)]
    errors = _lines(client.files.content(done.error_file_id))
    assert {e["custom_id"]: e["error"]["code"] for e in errors} == {"hang-0": "batch_cancelled",
                                                                    "hang-1": "batch_cancelled"}
    wait_until(lambda: sum(r.model == "hang" for r in gateway.fake.cancelled) >= 2, 10, "router calls cancelled")


def test_a_tenant_has_at_most_its_batch_concurrency_in_flight(gateway, client):
    hanging = lambda: [r for r in gateway.fake.requests if r.model == "hang" and r.tenant_id == "acme"]  # noqa: E731
    cancelled = lambda: [r for r in gateway.fake.cancelled if r.model == "hang"]  # noqa: E731
    before, cancelled_before = len(hanging()), len(cancelled())
    limit = gateway.settings.batch.concurrency_per_tenant
    upload = client.files.create(file=("in.jsonl", _jsonl([_chat_line(f"h{i}", model="hang")
                                                             for i in range(limit + 2)])), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: len(hanging()) - before == limit, 20, f"{limit} items in flight", interval_s=0.05)
    time.sleep(0.5)
    assert len(hanging()) - before == limit  # the other two wait for a slot
    client.batches.cancel(batch.id)
    done = _wait_batch(client, batch.id)
    assert done.request_counts.failed == limit + 2 and done.output_file_id is None
    wait_until(lambda: len(cancelled()) - cancelled_before == limit, 10, "the in-flight router calls cancelled")


def test_message_batch_with_results(gateway, claude):
    requests = [{"custom_id": f"m-{i}", "params": {"model": "tiny", "max_tokens": 2 + i, "messages": MESSAGES}}
                for i in range(3)]
    requests.append({"custom_id": "bad", "params": {"model": "tiny", "messages": MESSAGES}})  # no max_tokens
    batch = claude.messages.batches.create(requests=requests)
    assert batch.type == "message_batch" and batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 4 and batch.id.startswith("msgbatch_")
    wait_until(lambda: claude.messages.batches.retrieve(batch.id).processing_status == "ended", 20,
               "message batch ended", interval_s=0.05)
    ended = claude.messages.batches.retrieve(batch.id)
    assert ended.ended_at is not None and ended.results_url
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 3, 1, 0, 0)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    for i in range(3):
        assert results[f"m-{i}"].type == "succeeded"
        assert results[f"m-{i}"].message.content[0].text == canned_text(2 + i)
    assert results["bad"].type == "errored" and results["bad"].error.error.type == "invalid_request_error"
    assert batch.id in [b.id for b in claude.messages.batches.list(limit=5)]


def test_message_batch_cancel_and_bad_creates(gateway, claude):
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.batches.create(requests=[])
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        claude.messages.batches.create(requests=[{"custom_id": "a b", "params": {}}])
    with pytest.raises(anthropic.BadRequestError, match="more than once"):
        claude.messages.batches.create(requests=[{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}])
    hang = {"model": "hang", "max_tokens": 5, "messages": MESSAGES}
    batch = claude.messages.batches.create(requests=[{"custom_id": f"h{i}", "params": hang} for i in range(2)])
    with pytest.raises(anthropic.BadRequestError, match="still processing"):
        claude.get(f"/v1/messages/batches/{batch.id}/results", cast_to=object)
    canceled = claude.messages.batches.cancel(batch.id)
    assert canceled.processing_status in ("canceling", "ended") and canceled.cancel_initiated_at
    wait_until(lambda: claude.messages.batches.retrieve(batch.id).processing_status == "ended", 20, "ended")
    assert {r.result.type for r in claude.messages.batches.results(batch.id)} == {"canceled"}
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve("msgbatch_nope")


@pytest.fixture(scope="module")
def short_window_gateway(checkpoint_dir, tmp_path_factory):
    """A 1.5 s completion window, small files (4 KiB, 3 lines, 1 KiB a line), quick retries."""
    gw = InProcessGateway(checkpoint_dir, tmp_path_factory.mktemp("short-window"))
    gw.settings = replace(gw.settings, batch=BatchSettings(completion_window_s=1.5, retry_s=0.05, max_retry_s=0.2,
                                                           max_file_bytes=4096, max_requests=3,
                                                           max_line_bytes=1024))
    gw.start()
    yield gw
    gw.stop()


def test_expiry_keeps_partial_results(short_window_gateway):
    client = openai.OpenAI(base_url=short_window_gateway.base_url + "/v1", api_key=short_window_gateway.paid_key,
                           max_retries=0)
    lines = [_chat_line("quick"), _chat_line("overloaded", model="busy")]  # 529 until the window ends
    upload = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    started = time.monotonic()
    done = _wait_batch(client, batch.id)
    assert done.status == "expired" and done.expired_at and time.monotonic() - started < 10
    assert [line["custom_id"] for line in _lines(client.files.content(done.output_file_id))] == ["quick"]
    [expired] = _lines(client.files.content(done.error_file_id))
    assert expired["custom_id"] == "overloaded" and expired["error"]["code"] == "batch_expired"
    retried = [r for r in short_window_gateway.fake.requests if r.model == "busy"]
    assert len(retried) >= 2  # refused as overloaded: tried again, not answered with the 529
    sample = short_window_gateway.metrics.registry.get_sample_value
    assert sample("flotilla_gateway_batch_item_retries_total", {"status": "529"}) >= 1
    assert sample("flotilla_gateway_batch_items_total", {"result": "expired"}) == 1
    assert sample("flotilla_gateway_batch_items_in_flight") == 0


def test_file_size_and_line_limits(short_window_gateway):
    client = openai.OpenAI(base_url=short_window_gateway.base_url + "/v1", api_key=short_window_gateway.paid_key,
                           max_retries=0)
    with pytest.raises(openai.BadRequestError, match="at most 3 requests"):
        client.files.create(file=("in.jsonl", _jsonl([_chat_line(f"l{i}") for i in range(4)])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="the limit is 1024"):
        client.files.create(file=("in.jsonl", _jsonl([_chat_line("long", stop=["x" * 1200])])), purpose="batch")
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n" * 30_000)), purpose="batch")
    assert too_large.value.status_code == 413
    malformed = httpx.post(f"{short_window_gateway.base_url}/v1/files", content=b"--x\r\nnonsense",
                           headers={"authorization": f"Bearer {short_window_gateway.paid_key}",
                                    "content-type": "multipart/form-data; boundary=x"})
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    too_many_fields = httpx.post(f"{short_window_gateway.base_url}/v1/files",  # starlette's limit, as a 400
                                 files={"file": ("in.jsonl", b"{}\n")}, data={f"f{i}": "x" for i in range(5)},
                                 headers={"authorization": f"Bearer {short_window_gateway.paid_key}"})
    assert too_many_fields.status_code == 400 and "Too many fields" in too_many_fields.json()["error"]["message"]
