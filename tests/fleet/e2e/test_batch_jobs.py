"""Batch jobs on the real fleet (router, two workers, gateway as processes), through the real SDKs.

With Redis (jobs, leases and the usage ledger there): mid-batch the gateway is killed with SIGKILL and restarted, then
a worker is killed; every item is answered exactly once, with the answer a synchronous call gets, and the
ledger bills each item once, as batch traffic. Without Redis (`flotilla up`'s layout: SQLite in the state dir):
a Message Batch survives a gateway restart and its results come back through `.results()`."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import anthropic
import openai
import pytest

from flotilla.usage.summary import unique

from tests.support.fleet import fleet_config, start_fleet
from tests.support.waiting import wait_until

NUM_ITEMS = 16
BATCH_FLAGS = ["--batch-concurrency-per-tenant", "2", "--batch-lease-ttl-s", "2"]


def _body(i: int) -> dict:
    return {"model": "flotilla-tiny", "prompt": [5 + i, 17, 3 * i + 1, 40], "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def redis_fleet(tiny_checkpoint, tmp_path_factory, redis_server):
    redis_server.flush()
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("batch-redis"), num_workers=2,
                          worker_args=["--num-kv-blocks", "256"], gateway_args=BATCH_FLAGS, metrics=False)
    with start_fleet(config, redis=redis_server) as fleet:
        fleet.create_key("batch-tenant", key_id="batch-key")
        yield fleet


def _counts(client, batch_id: str) -> int:
    try:
        counts = client.batches.retrieve(batch_id).request_counts
    except openai.APIConnectionError:  # the gateway is restarting
        return 0
    return counts.completed + counts.failed


def test_kill_a_worker_and_restart_the_gateway_mid_batch(redis_fleet):
    client = openai.OpenAI(base_url=redis_fleet.url + "/v1", api_key=redis_fleet.api_key, max_retries=5)
    lines = [{"custom_id": f"item-{i}", "method": "POST", "url": "/v1/completions", "body": _body(i)}
             for i in range(NUM_ITEMS)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines)
                                                              .encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")

    wait_until(lambda: _counts(client, batch.id) >= 3, 60, "3 items answered", interval_s=0.05)
    redis_fleet.restart_gateway()  # SIGKILL, then a new gateway resumes the job from Redis
    wait_until(lambda: _counts(client, batch.id) >= 6, 60, "6 items answered", interval_s=0.05)
    redis_fleet.fleet.workers[0].kill()  # SIGKILL: its items in flight fail over to the other worker
    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 120, "batch completed",
               interval_s=0.2)

    done = client.batches.retrieve(batch.id)
    errors = client.files.content(done.error_file_id).text if done.error_file_id else ""
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == \
        (NUM_ITEMS, NUM_ITEMS, 0), errors
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"item-{i}" for i in range(NUM_ITEMS))
    for line in output:  # what the same request answers synchronously (greedy: the same text)
        i = int(line["custom_id"].removeprefix("item-"))
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["text"] == client.completions.create(**_body(i)).choices[0].text

    records = [r for r in redis_fleet.wait_ledger(NUM_ITEMS) if r.batch_id == batch.id]
    billed = unique(records)
    assert sorted(r.batch_item for r in billed) == list(range(NUM_ITEMS))
    assert all(r.status == "ok" and r.tenant == "batch-tenant" and r.output_tokens > 0 for r in billed)
    out = subprocess.run([sys.executable, "-m", "flotilla.cli", "usage", "--redis-url", redis_fleet.redis.url,
                          "--json"], capture_output=True, text=True, check=True).stdout
    rows = {(t["tenant"], t["traffic_class"]): t for t in map(json.loads, out.splitlines())}
    assert rows["batch-tenant", "batch"]["num_requests"] == NUM_ITEMS
    assert rows["batch-tenant", "interactive"]["num_requests"] == NUM_ITEMS  # the synchronous checks above


def test_a_create_retried_with_its_idempotency_key_makes_one_job(redis_fleet):
    client = openai.OpenAI(base_url=redis_fleet.url + "/v1", api_key=redis_fleet.api_key, max_retries=0)
    line = {"custom_id": "only", "method": "POST", "url": "/v1/completions", "body": _body(0)}
    upload = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
    create = {"input_file_id": upload.id, "endpoint": "/v1/completions", "completion_window": "24h",
              "extra_headers": {"Idempotency-Key": "nightly-2026-12-01"}}
    first, again = client.batches.create(**create), client.batches.create(**create)
    assert again.id == first.id
    assert [b.id for b in client.batches.list(limit=100)].count(first.id) == 1


def test_message_batch_survives_a_gateway_restart_without_redis(tiny_checkpoint, tmp_path):
    state_dir = tmp_path / "state"
    config = fleet_config(tiny_checkpoint, state_dir, worker_args=["--num-kv-blocks", "256"],
                          gateway_args=[*BATCH_FLAGS, "--batch-state-file", str(state_dir / "batches.db")],
                          metrics=False)
    with start_fleet(config, keys={"k": ("solo", "paid")}) as fleet:
        claude = anthropic.Anthropic(base_url=fleet.url, api_key=fleet.api_key, max_retries=5)
        params = [{"model": "flotilla-tiny", "max_tokens": 16, "temperature": 0,
                   "messages": [{"role": "user", "content": f"count to {i}"}]} for i in range(8)]
        batch = claude.messages.batches.create(requests=[{"custom_id": f"m{i}", "params": p}
                                                         for i, p in enumerate(params)])

        def answered() -> int:
            try:
                counts = claude.messages.batches.retrieve(batch.id).request_counts
            except anthropic.APIConnectionError:
                return 0
            return counts.succeeded + counts.errored

        wait_until(lambda: answered() >= 2, 60, "2 answered", interval_s=0.05)
        fleet.restart_gateway()
        wait_until(lambda: claude.messages.batches.retrieve(batch.id).processing_status == "ended", 120, "ended",
                   interval_s=0.2)
        results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
        assert sorted(results) == sorted(f"m{i}" for i in range(8))
        for i, p in enumerate(params):
            assert results[f"m{i}"].type == "succeeded"
            temperature = {"temperature": p.pop("temperature")}  # (this SDK's create() has no such argument)
            assert results[f"m{i}"].message.content[0].text == \
                claude.messages.create(**p, extra_body=temperature).content[0].text
