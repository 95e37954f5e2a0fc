"""The batch store in one SQLite file (`flotilla up` without Redis; ":memory:" when nothing is configured).

One connection, used from a worker thread under a lock: the gateway is one process, and each call is a short
transaction (WAL journal, so a kill -9 loses at most the call in flight).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from pathlib import Path

from flotilla.gateway.batch_jobs.records import ACTIVE_STATUSES, BatchJob, ItemResult, StoredFile

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, meta TEXT NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, dialect TEXT NOT NULL,
                                 created_at REAL NOT NULL, active INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, dialect, created_at);
CREATE TABLE IF NOT EXISTS items (job_id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (job_id TEXT NOT NULL, idx INTEGER NOT NULL, type TEXT NOT NULL,
                                    doc TEXT NOT NULL, PRIMARY KEY (job_id, idx));
CREATE TABLE IF NOT EXISTS leases (job_id TEXT PRIMARY KEY, owner TEXT NOT NULL, until REAL NOT NULL);
"""


class SQLiteBatchStore:
    def __init__(self, path: str | Path = ":memory:"):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    async def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        return await asyncio.to_thread(self._execute, sql, args)

    def _execute(self, sql: str, args: tuple) -> list[tuple]:
        with self._lock:
            cursor = self._db.execute(sql, args)
            return cursor.fetchall()

    async def put_file(self, meta: StoredFile, content: bytes) -> None:
        await self._run("INSERT OR REPLACE INTO files VALUES (?, ?, ?)", (meta.id, meta.to_json(), content))

    async def get_file(self, file_id: str) -> StoredFile | None:
        rows = await self._run("SELECT meta FROM files WHERE id = ?", (file_id,))
        return StoredFile.from_json(rows[0][0]) if rows else None

    async def file_content(self, file_id: str) -> bytes | None:
        rows = await self._run("SELECT content FROM files WHERE id = ?", (file_id,))
        return bytes(rows[0][0]) if rows else None

    async def delete_file(self, file_id: str) -> bool:
        return bool(await self._run("DELETE FROM files WHERE id = ? RETURNING id", (file_id,)))

    async def put_job(self, job: BatchJob) -> None:
        await self._run("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
                        (job.id, job.tenant, job.dialect, job.created_at, int(job.status in ACTIVE_STATUSES),
                         job.to_json()))

    async def get_job(self, job_id: str) -> BatchJob | None:
        rows = await self._run("SELECT doc FROM jobs WHERE id = ?", (job_id,))
        return BatchJob.from_json(rows[0][0]) if rows else None

    async def list_jobs(self, tenant: str, dialect: str) -> list[BatchJob]:
        rows = await self._run("SELECT doc FROM jobs WHERE tenant = ? AND dialect = ? ORDER BY created_at DESC, id",
                               (tenant, dialect))
        return [BatchJob.from_json(doc) for (doc,) in rows]

    async def active_job_ids(self) -> list[str]:
        return [job_id for (job_id,) in await self._run("SELECT id FROM jobs WHERE active = 1 ORDER BY created_at")]

    async def put_items(self, job_id: str, items: list[dict]) -> None:
        await self._run("INSERT OR REPLACE INTO items VALUES (?, ?)", (job_id, json.dumps(items)))

    async def get_items(self, job_id: str) -> list[dict]:
        rows = await self._run("SELECT doc FROM items WHERE job_id = ?", (job_id,))
        return json.loads(rows[0][0]) if rows else []

    async def put_result(self, job_id: str, index: int, result: ItemResult) -> bool:
        rows = await self._run("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?) RETURNING idx",
                               (job_id, index, result.type, result.to_json()))
        return bool(rows)

    async def get_results(self, job_id: str) -> dict[int, ItemResult]:
        rows = await self._run("SELECT idx, doc FROM results WHERE job_id = ?", (job_id,))
        return {idx: ItemResult.from_json(doc) for idx, doc in rows}

    async def result_counts(self, job_id: str) -> dict[str, int]:
        rows = await self._run("SELECT type, COUNT(*) FROM results WHERE job_id = ? GROUP BY type", (job_id,))
        return dict(rows)

    async def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        now = time.time()
        rows = await self._run(
            "INSERT INTO leases VALUES (?, ?, ?) ON CONFLICT (job_id) DO UPDATE SET owner = excluded.owner, "
            "until = excluded.until WHERE leases.owner = excluded.owner OR leases.until < ? RETURNING owner",
            (job_id, owner, now + ttl_s, now))
        return bool(rows)

    async def release_lease(self, job_id: str, owner: str) -> None:
        await self._run("DELETE FROM leases WHERE job_id = ? AND owner = ?", (job_id, owner))

    async def close(self) -> None:
        with self._lock:
            self._db.close()
