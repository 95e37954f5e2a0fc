"""UsageLedger: record() is O(1) and never waits; a background task writes batches to the sink. settle() writes
one record at once and returns when the sink has it (a request's final record, before its last byte is sent).

A write that fails (Redis down) is retried with backoff; records wait in memory meanwhile, bounded (the
oldest are dropped beyond `max_pending`, and counted). close() writes what is left, within a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from flotilla.usage.record import UsageRecord
from flotilla.usage.sinks import UsageSink

log = logging.getLogger(__name__)


class UsageLedger:
    def __init__(self, sink: UsageSink, max_batch: int = 256, max_pending: int = 100_000,
                 retry_s: float = 0.5, max_retry_s: float = 10.0, checkpoint_interval_s: float = 1.0,
                 settle_timeout_s: float = 1.0):
        self.sink = sink
        # A running stream leaves a checkpoint record this often (usage_meter.py): what a gateway that dies
        # mid-stream fails to bill is at most this much of its delivered output.
        self.checkpoint_interval_s = checkpoint_interval_s
        self.settle_timeout_s = settle_timeout_s
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._pending: deque[UsageRecord] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_written = 0
        self.num_dropped = 0

    def start(self) -> UsageLedger:
        self._task = asyncio.create_task(self._write_forever(), name="usage-ledger")
        return self

    def record(self, record: UsageRecord) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.num_dropped += 1
            log.error("usage ledger backlog full: dropped the oldest record")
        self._pending.append(record)
        self._wakeup.set()

    async def settle(self, record: UsageRecord) -> bool:
        """Write `record` now and return once the sink holds it (FileSink: fsynced; Redis: as durable as its
        append-only file), so a response is billed before its last byte leaves. A failing or slow sink (past
        `settle_timeout_s`) does not hold the response: the record joins the queue instead (False). Should the
        timed-out write land after all, summary.unique bills the request once."""
        try:
            await asyncio.wait_for(self.sink.append([record]), self.settle_timeout_s)
        except Exception as err:  # noqa: BLE001 - any sink failure or the timeout: the queue retries it
            log.warning("usage record %s not settled at once (%s): queued", record.request_id, err or "timeout")
            self.record(record)
            return False
        self.num_written += 1
        return True

    async def _write_forever(self) -> None:
        delay = self._retry_s
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                if await self._write_batch():
                    delay = self._retry_s
                else:
                    await asyncio.sleep(delay)  # backoff while the sink is down
                    delay = min(delay * 2, self._max_retry_s)

    async def _write_batch(self) -> bool:
        batch = [self._pending[i] for i in range(min(self._max_batch, len(self._pending)))]
        try:
            await self.sink.append(batch)
        except Exception as err:  # noqa: BLE001 - any sink failure: keep the records, retry later
            log.warning("usage ledger write failed (%d pending): %s", len(self._pending), err)
            return False
        for _ in batch:
            self._pending.popleft()
        self.num_written += len(batch)
        return True

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Until nothing is pending (True) or the timeout (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._pending and loop.time() < deadline:
            self._wakeup.set()
            await asyncio.sleep(0.01)
        return not self._pending

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._pending and loop.time() < deadline and await self._write_batch():
            pass
        if self._pending:
            log.error("usage ledger closed with %d records unwritten", len(self._pending))
        await self.sink.close()
