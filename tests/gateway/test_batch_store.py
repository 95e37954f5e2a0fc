"""The batch store's contract (gateway/batch_jobs/store.py), the same tests for both backends: SQLite in a file
(and reopened: what a restarted `flotilla up` gateway reads) and a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from flotilla.gateway.batch_jobs.records import (CANCELED, COMPLETED, IN_PROGRESS, OPENAI, SUCCEEDED, BatchJob,
                                                 ItemResult, JobOwner, StoredFile)
from flotilla.gateway.batch_jobs.redis_store import RedisBatchStore
from flotilla.gateway.batch_jobs.sqlite_store import SQLiteBatchStore
from flotilla.gateway.batch_jobs.store import UnknownCursor


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request, tmp_path):
    """A function that opens the store (again: same data)."""
    if request.param == "sqlite":
        return lambda: SQLiteBatchStore(tmp_path / "batches.db")
    url = request.getfixturevalue("redis_url")
    return lambda: RedisBatchStore(aioredis.Redis.from_url(url), owns_client=True)


def _job(job_id: str, created_at: float, tenant: str = "acme", status: str = IN_PROGRESS) -> BatchJob:
    return BatchJob(job_id, OPENAI, JobOwner("k", tenant, "paid", {}), "/v1/completions", created_at,
                    created_at + 60, status=status)


async def test_jobs_files_and_items_survive_reopening(open_store):
    store = open_store()
    await store.put_file(StoredFile("file-1", "acme", "in.jsonl", "batch", 3, 1.0), b"abc")
    for i, status in enumerate((IN_PROGRESS, COMPLETED, IN_PROGRESS)):
        await store.put_job(_job(f"batch_{i}", 100.0 + i, status=status))
    await store.put_job(_job("batch_other", 50.0, tenant="globex"))
    await store.put_items("batch_0", [{"custom_id": "a", "body": {"x": 1}}])
    await store.close()

    store = open_store()
    assert await store.file_content("file-1") == b"abc" and (await store.get_file("file-1")).bytes == 3
    assert [job.id for job in await store.list_jobs("acme", OPENAI)] == ["batch_2", "batch_1", "batch_0"]
    assert set(await store.active_job_ids()) == {"batch_0", "batch_2", "batch_other"}
    assert await store.get_items("batch_0") == [{"custom_id": "a", "body": {"x": 1}}]
    finished = await store.get_job("batch_0")
    finished.enter(COMPLETED, 200.0)
    await store.put_job(finished)
    assert "batch_0" not in await store.active_job_ids() and (await store.get_job("batch_0")).status == COMPLETED
    assert await store.delete_file("file-1") and not await store.delete_file("file-1")
    assert await store.get_file("file-1") is None and await store.get_job("batch_nope") is None
    await store.close()


async def test_files_are_listed_per_tenant_by_created_at_with_a_cursor(open_store):
    store = open_store()
    # Two files share a created_at: the id breaks the tie, the same way in both backends.
    for file_id, created_at, purpose in (("file-a", 3.0, "batch"), ("file-b", 1.0, "batch_output"),
                                         ("file-c", 2.0, "batch"), ("file-d", 2.0, "batch")):
        await store.put_file(StoredFile(file_id, "acme", "f.jsonl", purpose, 1, created_at), b"x")
    await store.put_file(StoredFile("file-z", "globex", "f.jsonl", "batch", 1, 5.0), b"x")
    await store.close()

    store = open_store()

    async def ids(purpose=None, descending=True, after=None, limit=10):
        files, more = await store.list_files("acme", purpose, descending, after, limit)
        return [f.id for f in files], more

    assert await ids() == (["file-a", "file-d", "file-c", "file-b"], False)
    assert await ids(descending=False) == (["file-b", "file-c", "file-d", "file-a"], False)
    assert await ids(limit=2) == (["file-a", "file-d"], True)
    assert await ids(after="file-d", limit=2) == (["file-c", "file-b"], False)
    assert await ids(descending=False, after="file-c", limit=1) == (["file-d"], True)
    assert await ids(purpose="batch") == (["file-a", "file-d", "file-c"], False)
    assert await ids(purpose="batch_output") == (["file-b"], False)
    assert await ids(purpose="fine-tune") == ([], False)
    for cursor, purpose in (("file-z", None), ("file-nope", None), ("file-b", "batch")):  # not in that listing
        with pytest.raises(UnknownCursor):
            await store.list_files("acme", purpose, True, cursor, 10)
    assert await store.delete_file("file-d")
    assert await ids() == (["file-a", "file-c", "file-b"], False)
    assert await ids(purpose="batch") == (["file-a", "file-c"], False)
    await store.close()


async def test_a_state_file_from_before_listing_lists_its_files(tmp_path):
    """`flotilla up`'s batches.db written by a gateway without the listing's columns (the old files table)."""
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.execute("CREATE TABLE files (id TEXT PRIMARY KEY, meta TEXT NOT NULL, content BLOB NOT NULL)")
        old.execute("INSERT INTO files VALUES (?, ?, ?)",
                    ("file-old", StoredFile("file-old", "acme", "in.jsonl", "batch", 1, 7.0).to_json(), b"x"))
    store = SQLiteBatchStore(path)
    await store.put_file(StoredFile("file-new", "acme", "in.jsonl", "batch", 1, 8.0), b"y")
    files, _ = await store.list_files("acme", "batch", True, None, 10)
    assert [f.id for f in files] == ["file-new", "file-old"]
    await store.close()


async def test_an_item_keeps_its_first_result_and_counts_once(open_store):
    store = open_store()
    first = ItemResult(SUCCEEDED, 200, {"ok": True}, "req_1")
    assert await store.put_result("batch_1", 0, first)
    assert not await store.put_result("batch_1", 0, ItemResult(CANCELED))  # a re-run after a crash: ignored
    results = await asyncio.gather(*(store.put_result("batch_1", 1, ItemResult(SUCCEEDED, 200, {"n": n}))
                                     for n in range(5)))
    assert sum(results) == 1
    assert (await store.get_results("batch_1"))[0] == first
    assert await store.result_counts("batch_1") == {SUCCEEDED: 2}
    await store.close()


async def test_a_lease_has_one_holder_until_it_lapses(open_store):
    store = open_store()
    assert await store.acquire_lease("batch_1", "gw_a", 0.3)
    assert not await store.acquire_lease("batch_1", "gw_b", 0.3)
    assert await store.acquire_lease("batch_1", "gw_a", 0.3)  # renewed by its holder
    await asyncio.sleep(0.5)
    assert await store.acquire_lease("batch_1", "gw_b", 5)  # lapsed: a dead gateway's job is taken over
    await store.release_lease("batch_1", "gw_a")  # not the holder: no effect
    assert not await store.acquire_lease("batch_1", "gw_a", 5)
    await store.release_lease("batch_1", "gw_b")
    assert await store.acquire_lease("batch_1", "gw_a", 5)
    await store.close()
