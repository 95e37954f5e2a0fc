"""The usage ledger's own parts: the background writer (never blocks, retries a failing sink), the file and
Redis sinks, and `flotilla usage` summing per tenant over a time range (each request id once)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import redis.asyncio as aioredis

from flotilla.usage.ledger import UsageLedger
from flotilla.usage.record import UsageRecord
from flotilla.usage.sinks import FileSink, RedisStreamSink


def _record(request_id: str, tenant: str, output: int, finished_at: float, status: str = "ok",
            batch_item: tuple[str, int] = ("", -1), price_factor: float = 1.0) -> UsageRecord:
    return UsageRecord(request_id, tenant, "k1", "m@v1", "v1", 10, 4, output, status, "", 1, finished_at - 1,
                       finished_at, *batch_item, price_factor)


class _FlakySink:
    def __init__(self, failures: int):
        self.failures = failures
        self.written: list[UsageRecord] = []

    async def append(self, records) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("down")
        self.written.extend(records)

    async def close(self) -> None:
        pass


async def test_ledger_retries_a_failing_sink_and_keeps_order():
    sink = _FlakySink(failures=2)
    ledger = UsageLedger(sink, retry_s=0.01).start()
    for i in range(5):
        ledger.record(_record(f"r{i}", "t", i, 100.0))  # returns at once, sink down or not
    assert await ledger.flush(5.0)
    await ledger.close()
    assert [r.request_id for r in sink.written] == [f"r{i}" for i in range(5)]


@pytest.mark.integration  # real Redis
async def test_redis_sink_round_trip(redis_url):
    client = aioredis.from_url(redis_url, decode_responses=True)
    ledger = UsageLedger(RedisStreamSink(client, owns_client=True)).start()
    ledger.record(_record("a", "t1", 3, 1000.0))
    await ledger.close()
    import redis

    from flotilla.usage.sinks import read_redis

    with redis.Redis.from_url(redis_url) as sync_client:
        assert list(read_redis(sync_client)) == [_record("a", "t1", 3, 1000.0)]


@pytest.mark.integration  # `flotilla usage` as a command
def test_flotilla_usage_sums_per_tenant_and_time_range(tmp_path):
    path = tmp_path / "usage.jsonl"
    records = [_record("a", "t1", 5, 1000.0), _record("b", "t1", 7, 2000.0), _record("c", "t2", 1, 2000.0),
               _record("a", "t1", 5, 1000.0),  # a write retried after a lost reply: counted once
               _record("d", "t1", 2, 3000.0, status="cancelled"),
               # Batch item 0 refused once, then served: one request, billed once; item 1 re-run after a restart.
               # At the batch rate: billable (10 + 3) * 0.5 -> 7 and (10 + 4) * 0.5 = 7.
               _record("e", "t1", 0, 1500.0, status="error", batch_item=("batch_1", 0), price_factor=0.5),
               _record("f", "t1", 3, 1600.0, batch_item=("batch_1", 0), price_factor=0.5),
               _record("g", "t1", 4, 1700.0, batch_item=("batch_1", 1), price_factor=0.5),
               _record("h", "t1", 4, 1800.0, batch_item=("batch_1", 1), price_factor=0.5)]
    asyncio.run(FileSink(path).append(records))
    with open(path, "a") as torn:
        torn.write('{"request_id": "torn')  # a writer killed mid-line
    out = subprocess.run([sys.executable, "-m", "flotilla.cli", "usage", "--file", str(path), "--since", "500",
                          "--until", "2500", "--json"], capture_output=True, text=True, check=True).stdout
    totals = {(t["tenant"], t["traffic_class"]): t for t in map(json.loads, out.splitlines())}
    assert totals["t1", "interactive"] == {"tenant": "t1", "traffic_class": "interactive", "num_requests": 2,
                                           "num_ok": 2, "input_tokens": 20, "cached_input_tokens": 8,
                                           "output_tokens": 12, "billable_tokens": 32}
    assert totals["t1", "batch"]["num_requests"] == 2 and totals["t1", "batch"]["output_tokens"] == 7
    assert totals["t1", "batch"]["billable_tokens"] == 14
    assert totals["t2", "interactive"]["output_tokens"] == 1
    table = subprocess.run([sys.executable, "-m", "flotilla.cli", "usage", "--file", str(path), "--tenant", "t1"],
                           capture_output=True, text=True, check=True).stdout
    assert table.splitlines()[0].split()[-1] == "billable"
    assert table.splitlines()[1].split() == ["t1", "batch", "2", "2", "20", "8", "7", "14"]
    assert table.splitlines()[2].split() == ["t1", "interactive", "3", "2", "30", "12", "14", "44"]


def test_checkpoints_bill_a_request_once_and_a_final_record_supersedes_them():
    from flotilla.usage.summary import unique

    records = [_record("a", "t", 0, 10.0, status="open"), _record("a", "t", 4, 11.0, status="open"),
               _record("a", "t", 9, 12.0), _record("a", "t", 6, 11.5, status="open"),  # queued late: still final
               _record("b", "t", 0, 10.0, status="open"), _record("b", "t", 3, 11.0, status="open"),
               _record("b", "t", 2, 10.5, status="open"),  # gateway died: the most delivered
               _record("c", "t", 0, 10.0, status="open")]  # died before delivering anything: not billed
    settled = {r.request_id: r for r in unique(records)}
    assert len(unique(records)) == 2
    assert (settled["a"].status, settled["a"].output_tokens) == ("ok", 9)
    assert (settled["b"].status, settled["b"].output_tokens, settled["b"].finished_at) == ("interrupted", 3, 11.0)


async def test_settle_writes_at_once_and_queues_when_the_sink_fails():
    sink = _FlakySink(failures=1)
    ledger = UsageLedger(sink, retry_s=0.01).start()
    assert not await ledger.settle(_record("a", "t", 1, 10.0))  # failed: queued, retried in the background
    assert await ledger.settle(_record("b", "t", 1, 10.0))
    assert "b" in [r.request_id for r in sink.written]  # written before settle returned
    assert await ledger.flush(5.0)
    await ledger.close()
    assert sorted(r.request_id for r in sink.written) == ["a", "b"]


@pytest.mark.integration  # `flotilla usage` as a command
def test_a_request_checkpointed_in_one_range_and_finished_in_the_next_is_billed_in_the_later_one(tmp_path):
    path = tmp_path / "usage.jsonl"
    asyncio.run(FileSink(path).append([_record("a", "t1", 3, 1000.0, status="open"), _record("a", "t1", 8, 3000.0),
                                       _record("b", "t1", 2, 1500.0, status="open")]))

    def output_tokens(since: str, until: str) -> int:
        out = subprocess.run([sys.executable, "-m", "flotilla.cli", "usage", "--file", str(path), "--since", since,
                              "--until", until, "--json"], capture_output=True, text=True, check=True).stdout
        return sum(json.loads(line)["output_tokens"] for line in out.splitlines())

    assert output_tokens("500", "2000") == 2  # b (interrupted); not a's checkpoint
    assert output_tokens("2000", "4000") == 8  # a, by its final record
