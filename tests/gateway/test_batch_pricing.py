"""Batch items are charged to the tenant's token quota at the batch rate, in both dialects, with quotas in a real
Redis; `flotilla usage` shows the same figure as billable tokens. The gateway here charges paid batch items a
quarter (`--batch-price-factor-paid 0.25`); interactive calls are charged in full."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import replace

import anthropic
import openai
import pytest
import redis

from flotilla.gateway.batch_jobs.settings import BatchSettings
from flotilla.tenancy.redis_quota import tenant_keys
from flotilla.usage.pricing import charged_tokens
from flotilla.usage.sinks import FileSink

from tests.support.waiting import wait_until

from .in_process_gateway import InProcessGateway

PRICE_FACTOR = 0.25
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def gateway(redis_server, checkpoint_dir, tmp_path_factory):
    redis_server.flush()
    keys_dir = tmp_path_factory.mktemp("batch-pricing")
    gw = InProcessGateway(checkpoint_dir, keys_dir, ledger_sink=FileSink(keys_dir / "usage.jsonl"),
                          redis_url=redis_server.url)
    gw.settings = replace(gw.settings, batch=BatchSettings(price_factor_paid=PRICE_FACTOR))
    gw.usage_log = keys_dir / "usage.jsonl"
    yield gw.start()
    gw.stop()


@pytest.fixture(scope="module")
def quota(gateway):
    """The metered tenant's tokens in its quota window, as a function (read from Redis)."""
    client = redis.Redis.from_url(gateway.settings.redis_url)
    total_key = tenant_keys("metered")[2]
    yield lambda: int(client.get(total_key) or 0)
    client.close()


def _settled_at(quota, expected: int) -> None:
    wait_until(lambda: quota() == expected, 10, f"the quota at {expected} tokens (now {quota()})", interval_s=0.05)


def test_an_interactive_call_is_charged_in_full(gateway, quota):
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.metered_key, max_retries=0)
    before = quota()
    answer = client.chat.completions.create(model="tiny", max_tokens=6, messages=MESSAGES)
    _settled_at(quota, before + answer.usage.total_tokens)


def test_openai_batch_items_are_charged_at_the_batch_rate(gateway, quota):
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.metered_key, max_retries=0)
    before = quota()
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": MESSAGES, "max_tokens": 3 + 2 * i}} for i in range(3)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 20, "batch completed",
               interval_s=0.05)
    output = client.files.content(client.batches.retrieve(batch.id).output_file_id).text.splitlines()
    totals = [json.loads(line)["response"]["body"]["usage"]["total_tokens"] for line in output]
    assert len(totals) == 3
    charged = sum(charged_tokens(total, PRICE_FACTOR) for total in totals)
    assert charged < sum(totals)
    _settled_at(quota, before + charged)


def test_message_batch_items_are_charged_at_the_batch_rate(gateway, quota):
    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.metered_key, max_retries=0)
    before = quota()
    batch = claude.messages.batches.create(requests=[
        {"custom_id": f"m{i}", "params": {"model": "tiny", "max_tokens": 4 + i, "messages": MESSAGES}}
        for i in range(2)])
    wait_until(lambda: claude.messages.batches.retrieve(batch.id).processing_status == "ended", 20,
               "message batch ended", interval_s=0.05)
    usages = [r.result.message.usage for r in claude.messages.batches.results(batch.id)]
    # Anthropic's input_tokens leave out the cached prompt tokens; the quota counts the whole prompt.
    totals = [u.input_tokens + (u.cache_read_input_tokens or 0) + u.output_tokens for u in usages]
    _settled_at(quota, before + sum(charged_tokens(total, PRICE_FACTOR) for total in totals))


def test_flotilla_usage_shows_the_charged_tokens_as_billable(gateway, quota):
    """After the tests above: the ledger's billable tokens are what the quota was charged, class by class."""
    out = subprocess.run([sys.executable, "-m", "flotilla.cli", "usage", "--file", str(gateway.usage_log),
                          "--tenant", "metered", "--json"], capture_output=True, text=True, check=True).stdout
    totals = {t["traffic_class"]: t for t in map(json.loads, out.splitlines())}
    interactive, batch = totals["interactive"], totals["batch"]
    assert batch["num_requests"] == 5 and interactive["num_requests"] == 1
    assert interactive["billable_tokens"] == interactive["input_tokens"] + interactive["output_tokens"]
    assert 0 < batch["billable_tokens"] < batch["input_tokens"] + batch["output_tokens"]
    assert interactive["billable_tokens"] + batch["billable_tokens"] == quota()
