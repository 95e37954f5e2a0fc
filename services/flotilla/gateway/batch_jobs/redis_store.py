"""The batch store in Redis (the gateway has --redis-url): shared by every gateway, so a job started on one is
resumed by another. Keys under flotilla:batch:; a result and its count move together (one Lua script). A
tenant's files are indexed in sorted sets by created_at (all of them, and per purpose): ties sort by id, so
the order is (created_at, id) as in SQLite, and a page is read by rank."""

from __future__ import annotations

import json

from flotilla.gateway.batch_jobs.records import BatchJob, ItemResult, StoredFile
from flotilla.gateway.batch_jobs.store import UnknownCursor

PREFIX = "flotilla:batch:"
ACTIVE = PREFIX + "active"
# KEYS: results hash, counts hash; ARGV: index, result JSON, result type.
_PUT_RESULT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""
# KEYS: lease; ARGV: owner, ttl ms. Take it when free, renew it when ours.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# KEYS: file index; ARGV: cursor id ("" = from the start), count, "1" = descending. nil: no such cursor.
_FILE_PAGE = """
local rank_of, range = 'ZRANK', 'ZRANGE'
if ARGV[3] == '1' then rank_of, range = 'ZREVRANK', 'ZREVRANGE' end
local start = 0
if ARGV[1] ~= '' then
  local rank = redis.call(rank_of, KEYS[1], ARGV[1])
  if not rank then return false end
  start = rank + 1
end
return redis.call(range, KEYS[1], start, start + tonumber(ARGV[2]) - 1)
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _file_index(tenant: str, purpose: str | None = None) -> str:
    """Purposes are this API's own words (no ':'), so the two key shapes never meet."""
    return f"{PREFIX}files-of:{tenant}" if purpose is None else f"{PREFIX}files-for:{purpose}:{tenant}"


class RedisBatchStore:
    def __init__(self, client, owns_client: bool = False):
        self._redis = client  # redis.asyncio.Redis
        self._owns_client = owns_client
        self._put_result = client.register_script(_PUT_RESULT)
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._file_page = client.register_script(_FILE_PAGE)

    async def put_file(self, meta: StoredFile, content: bytes) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(f"{PREFIX}file:{meta.id}", mapping={"meta": meta.to_json(), "content": content})
            for index in (_file_index(meta.tenant), _file_index(meta.tenant, meta.purpose)):
                pipe.zadd(index, {meta.id: meta.created_at})
            await pipe.execute()

    async def get_file(self, file_id: str) -> StoredFile | None:
        meta = await self._redis.hget(f"{PREFIX}file:{file_id}", "meta")
        return StoredFile.from_json(meta) if meta is not None else None

    async def file_content(self, file_id: str) -> bytes | None:
        return await self._redis.hget(f"{PREFIX}file:{file_id}", "content")

    async def delete_file(self, file_id: str) -> bool:
        meta = await self.get_file(file_id)
        if meta is None:
            return False
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(f"{PREFIX}file:{file_id}")
            for index in (_file_index(meta.tenant), _file_index(meta.tenant, meta.purpose)):
                pipe.zrem(index, file_id)
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    async def list_files(self, tenant: str, purpose: str | None, descending: bool, after: str | None,
                         limit: int) -> tuple[list[StoredFile], bool]:
        ids = await self._file_page(keys=[_file_index(tenant, purpose)],
                                    args=[after or "", limit + 1, "1" if descending else "0"])
        if ids is None:
            raise UnknownCursor(after)
        async with self._redis.pipeline(transaction=False) as pipe:
            for file_id in ids[:limit]:
                pipe.hget(f"{PREFIX}file:{_text(file_id)}", "meta")
            metas = await pipe.execute()
        # A file deleted between the two reads is left out.
        return [StoredFile.from_json(meta) for meta in metas if meta is not None], len(ids) > limit

    async def put_job(self, job: BatchJob) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(f"{PREFIX}job:{job.id}", job.to_json())
            pipe.zadd(f"{PREFIX}jobs:{job.dialect}:{job.tenant}", {job.id: job.created_at})
            if job.is_active:
                pipe.sadd(ACTIVE, job.id)
            else:
                pipe.srem(ACTIVE, job.id)
            await pipe.execute()

    async def get_job(self, job_id: str) -> BatchJob | None:
        doc = await self._redis.get(f"{PREFIX}job:{job_id}")
        return BatchJob.from_json(doc) if doc is not None else None

    async def list_jobs(self, tenant: str, dialect: str) -> list[BatchJob]:
        ids = await self._redis.zrevrange(f"{PREFIX}jobs:{dialect}:{tenant}", 0, -1)
        if not ids:
            return []
        docs = await self._redis.mget([f"{PREFIX}job:{_text(i)}" for i in ids])
        return [BatchJob.from_json(doc) for doc in docs if doc is not None]

    async def active_job_ids(self) -> list[str]:
        return sorted(_text(i) for i in await self._redis.smembers(ACTIVE))

    async def put_items(self, job_id: str, items: list[dict]) -> None:
        await self._redis.set(f"{PREFIX}items:{job_id}", json.dumps(items))

    async def get_items(self, job_id: str) -> list[dict]:
        doc = await self._redis.get(f"{PREFIX}items:{job_id}")
        return json.loads(doc) if doc is not None else []

    async def put_result(self, job_id: str, index: int, result: ItemResult) -> bool:
        keys = [f"{PREFIX}results:{job_id}", f"{PREFIX}counts:{job_id}"]
        return bool(await self._put_result(keys=keys, args=[index, result.to_json(), result.type]))

    async def get_results(self, job_id: str) -> dict[int, ItemResult]:
        raw = await self._redis.hgetall(f"{PREFIX}results:{job_id}")
        return {int(index): ItemResult.from_json(doc) for index, doc in raw.items()}

    async def result_counts(self, job_id: str) -> dict[str, int]:
        raw = await self._redis.hgetall(f"{PREFIX}counts:{job_id}")
        return {_text(k): int(v) for k, v in raw.items()}

    async def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self._acquire(keys=[f"{PREFIX}lease:{job_id}"], args=[owner, max(1, int(ttl_s * 1000))]))

    async def release_lease(self, job_id: str, owner: str) -> None:
        await self._release(keys=[f"{PREFIX}lease:{job_id}"], args=[owner])

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()
