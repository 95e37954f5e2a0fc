"""API keys for the gateway: the tenancy key records and the JSON keys file, plus an in-memory store.

Keys file (JSON): {"keys": [{"key_id", "sha256": "<hex digest of the key>", "tenant", "tier": "paid"|"free",
optional "priority_class", "limits", "cache_salt", "safety_policy"}]}. Plaintext keys are shown once, when generated, and
never written. Redis-backed keys and quotas live in flotilla.tenancy (see `flotilla keys`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from flotilla.tenancy.file_keys import read_keys_file, write_keys_file
from flotilla.tenancy.key_hashing import KEY_PREFIX, generate_key, hash_key
from flotilla.tenancy.key_store import check_unique
from flotilla.tenancy.records import TIERS, TenantKey

KeyEntry = TenantKey  # the record a key resolves to (tenant, tier, class, limits, cache salt)

__all__ = ["KEY_PREFIX", "TIERS", "KeyEntry", "KeyStore", "generate_key", "hash_key", "write_keys_file"]


class KeyStore:
    """A fixed set of keys in memory, looked up by digest (tests and embedding; the server uses
    flotilla.tenancy's file or Redis store, which see revocations at once)."""

    def __init__(self, entries: Iterable[KeyEntry]):
        self.entries = list(entries)
        check_unique(self.entries)
        self._by_digest = {e.sha256: e for e in self.entries}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyStore:
        return cls(read_keys_file(path))

    def lookup(self, key: str) -> KeyEntry | None:
        return self._by_digest.get(hash_key(key))

    def __len__(self) -> int:
        return len(self.entries)

    def as_async(self) -> _AsyncKeys:
        return _AsyncKeys(self)


class _AsyncKeys:
    """The tenancy KeyStore interface (lookup only) over an in-memory KeyStore."""

    def __init__(self, store: KeyStore):
        self._store = store

    async def lookup(self, api_key: str) -> KeyEntry | None:
        return self._store.lookup(api_key)

    async def close(self) -> None:
        pass
