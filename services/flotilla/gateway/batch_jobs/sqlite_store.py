"""The batch store in one SQLite file (`flotilla up` without Redis; ":memory:" when nothing is configured).

One connection, used from a worker thread under a lock: the gateway is one process, and each call is a short
transaction (WAL journal, so a kill -9 loses at most the call in flight). Files carry their tenant, purpose and
created_at as columns, indexed for listing; a file from before those columns has them filled in from its meta.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from pathlib import Path

from flotilla.gateway.batch_jobs.records import ACTIVE_STATUSES, BatchJob, ItemResult, StoredFile
from flotilla.gateway.batch_jobs.store import UnknownCursor

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, meta TEXT NOT NULL, content BLOB NOT NULL, tenant TEXT,
                                  purpose TEXT, created_at REAL);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, dialect TEXT NOT NULL,
                                 created_at REAL NOT NULL, active INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, dialect, created_at);
CREATE TABLE IF NOT EXISTS items (job_id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (job_id TEXT NOT NULL, idx INTEGER NOT NULL, type TEXT NOT NULL,
                                    doc TEXT NOT NULL, PRIMARY KEY (job_id, idx));
CREATE TABLE IF NOT EXISTS leases (job_id TEXT PRIMARY KEY, owner TEXT NOT NULL, until REAL NOT NULL);
"""
_FILE_COLUMNS = ("tenant", "purpose", "created_at")
_FILES_INDEX = "CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, created_at, id)"


class SQLiteBatchStore:
    def __init__(self, path: str | Path = ":memory:"):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._add_file_columns()
        self._db.execute(_FILES_INDEX)

    def _add_file_columns(self) -> None:
        """A state file written before files were listed: its files table gets the listing's columns."""
        present = {row[1] for row in self._db.execute("PRAGMA table_info(files)")}
        missing = [name for name in _FILE_COLUMNS if name not in present]
        for name in missing:
            self._db.execute(f"ALTER TABLE files ADD COLUMN {name}")
        if missing:
            self._db.execute("UPDATE files SET tenant = json_extract(meta, '$.tenant'), purpose = "
                             "json_extract(meta, '$.purpose'), created_at = json_extract(meta, '$.created_at')")

    async def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        return await asyncio.to_thread(self._execute, sql, args)

    def _execute(self, sql: str, args: tuple) -> list[tuple]:
        with self._lock:
            cursor = self._db.execute(sql, args)
            return cursor.fetchall()

    async def put_file(self, meta: StoredFile, content: bytes) -> None:
        await self._run("INSERT OR REPLACE INTO files (id, meta, content, tenant, purpose, created_at) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (meta.id, meta.to_json(), content, meta.tenant, meta.purpose, meta.created_at))

    async def get_file(self, file_id: str) -> StoredFile | None:
        rows = await self._run("SELECT meta FROM files WHERE id = ?", (file_id,))
        return StoredFile.from_json(rows[0][0]) if rows else None

    async def file_content(self, file_id: str) -> bytes | None:
        rows = await self._run("SELECT content FROM files WHERE id = ?", (file_id,))
        return bytes(rows[0][0]) if rows else None

    async def delete_file(self, file_id: str) -> bool:
        return bool(await self._run("DELETE FROM files WHERE id = ? RETURNING id", (file_id,)))

    async def list_files(self, tenant: str, purpose: str | None, descending: bool, after: str | None,
                         limit: int) -> tuple[list[StoredFile], bool]:
        return await asyncio.to_thread(self._list_files, tenant, purpose, descending, after, limit)

    def _list_files(self, tenant: str, purpose: str | None, descending: bool, after: str | None,
                    limit: int) -> tuple[list[StoredFile], bool]:
        where, args = "tenant = ?", [tenant]
        if purpose is not None:
            where, args = where + " AND purpose = ?", [*args, purpose]
        with self._lock:  # the cursor and its page read together (every call of this process takes the lock)
            if after:
                cursor = self._db.execute(f"SELECT created_at, id FROM files WHERE {where} AND id = ?",
                                          (*args, after)).fetchone()
                if cursor is None:
                    raise UnknownCursor(after)
                before_or_after = "<" if descending else ">"
                where, args = where + f" AND (created_at, id) {before_or_after} (?, ?)", [*args, *cursor]
            order = "DESC" if descending else "ASC"
            rows = self._db.execute(f"SELECT meta FROM files WHERE {where} ORDER BY created_at {order}, id {order} "
                                    "LIMIT ?", (*args, limit + 1)).fetchall()
        return [StoredFile.from_json(meta) for (meta,) in rows[:limit]], len(rows) > limit

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
