"""Keys in Redis: one hash per key digest (`flotilla:key:<sha256>`) and an index key_id -> digest.

Nothing is cached by the gateway, so a revoked key (its hash deleted) is refused by every gateway from
the next request on. A lookup is one round trip (HGETALL).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import redis.asyncio as aioredis

from flotilla.tenancy.errors import DuplicateKeyError, UnknownKeyError
from flotilla.tenancy.key_hashing import hash_key
from flotilla.tenancy.redis_conn import KEY_PREFIX, call, connect
from flotilla.tenancy.records import Limits, TenantKey

KEY_INDEX = KEY_PREFIX + "keyids"
_LIMIT_FIELDS = ("tokens_per_minute", "requests_per_minute", "max_concurrent")


def record_key(sha256: str) -> str:
    return f"{KEY_PREFIX}key:{sha256}"


def to_hash(entry: TenantKey) -> dict[str, str]:
    fields = {"key_id": entry.key_id, "tenant": entry.tenant, "tier": entry.tier,
              "priority_class": entry.priority_class, "cache_salt": entry.cache_salt,
              "safety_policy": entry.safety_policy}
    fields.update({name: str(getattr(entry.limits, name)) for name in _LIMIT_FIELDS})
    return fields


def from_hash(sha256: str, fields: dict[str, str]) -> TenantKey:
    limits = Limits(**{name: int(fields.get(name, 0)) for name in _LIMIT_FIELDS})
    return TenantKey(fields["key_id"], sha256, fields["tenant"], fields["tier"], fields["priority_class"],
                     limits, fields.get("cache_salt", ""), fields.get("safety_policy", ""))


class RedisKeyStore:
    def __init__(self, client: aioredis.Redis, owns_client: bool = False):
        self.client = client
        self._owns_client = owns_client

    async def lookup(self, api_key: str) -> TenantKey | None:
        return await self.lookup_digest(hash_key(api_key))

    async def lookup_digest(self, sha256: str) -> TenantKey | None:
        fields = await call(self.client.hgetall(record_key(sha256)))
        return from_hash(sha256, fields) if fields else None

    async def create(self, entry: TenantKey) -> None:
        if not await call(self.client.hsetnx(KEY_INDEX, entry.key_id, entry.sha256)):
            raise DuplicateKeyError(entry.key_id)
        await call(self.client.hset(record_key(entry.sha256), mapping=to_hash(entry)))

    async def list(self) -> list[TenantKey]:
        index = await call(self.client.hgetall(KEY_INDEX))
        entries = [await self.lookup_digest(digest) for digest in index.values()]
        return sorted((e for e in entries if e is not None), key=lambda e: e.key_id)

    async def revoke(self, key_id: str) -> bool:
        digest = await call(self.client.hget(KEY_INDEX, key_id))
        if digest is None:
            return False
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(record_key(digest))
            pipe.hdel(KEY_INDEX, key_id)
            await call(pipe.execute())
        return True

    async def set_limits(self, key_id: str, limits: Limits) -> TenantKey:
        digest = await call(self.client.hget(KEY_INDEX, key_id))
        entry = await self.lookup_digest(digest) if digest else None
        if entry is None:
            raise UnknownKeyError(key_id)
        updated = replace(entry, limits=limits)
        await call(self.client.hset(record_key(digest), mapping=to_hash(updated)))
        return updated

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()


def put_key(redis_url: str, entry: TenantKey) -> None:
    """Create `entry`, replacing a key with the same id (`flotilla up` re-keys "local" on each start)."""

    async def main() -> None:
        store = RedisKeyStore(connect(redis_url), owns_client=True)
        try:
            await store.revoke(entry.key_id)
            await store.create(entry)
        finally:
            await store.close()

    asyncio.run(main())
