"""Where usage records go: a Redis stream (shared by every gateway) or an append-only JSON-lines file
(`flotilla up` without Redis). Both only append; readers take a time range."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from flotilla.usage.record import UsageRecord

STREAM_KEY = "flotilla:usage"
# Stream ids are the write time; records are filtered by finished_at, so read a little wider than asked.
_ID_SLACK_MS = 120_000


class UsageSink(Protocol):
    async def append(self, records: Sequence[UsageRecord]) -> None: ...

    async def close(self) -> None: ...


class RedisStreamSink:
    """XADD per record in one pipeline (MULTI/EXEC: a batch lands whole or not at all)."""

    def __init__(self, client, stream_key: str = STREAM_KEY, owns_client: bool = False):
        self._client = client  # redis.asyncio.Redis
        self._key = stream_key
        self._owns_client = owns_client

    async def append(self, records: Sequence[UsageRecord]) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            for record in records:
                pipe.xadd(self._key, record.to_fields())
            await pipe.execute()

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


class FileSink:
    """One JSON line per record, appended and flushed per batch (O_APPEND: concurrent writers never interleave
    within a line of one write)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    async def append(self, records: Sequence[UsageRecord]) -> None:
        data = "".join(record.to_json() + "\n" for record in records).encode()
        await asyncio.to_thread(self._write, data)

    def _write(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    async def close(self) -> None:
        return None


def read_file(path: str | Path, since: float = 0.0, until: float = float("inf")) -> Iterator[UsageRecord]:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        if line.strip():  # a torn last line (killed writer) is skipped, not fatal
            try:
                record = UsageRecord.from_fields(json.loads(line))
            except (ValueError, json.JSONDecodeError):
                continue
            if since <= record.finished_at < until:
                yield record


def read_redis(client, since: float = 0.0, until: float = float("inf"),
               stream_key: str = STREAM_KEY) -> Iterator[UsageRecord]:
    """From a synchronous redis.Redis client (the CLI), in pages."""
    start = f"{max(0, int(since * 1000) - _ID_SLACK_MS)}-0"
    end = "+" if until == float("inf") else f"{int(until * 1000) + _ID_SLACK_MS}-0"
    while True:
        page = client.xrange(stream_key, min=start, max=end, count=1000)
        for _, raw in page:
            record = UsageRecord.from_fields({_text(k): _text(v) for k, v in raw.items()})
            if since <= record.finished_at < until:
                yield record
        if len(page) < 1000:
            return
        start = "(" + _text(page[-1][0])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
