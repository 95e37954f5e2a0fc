"""Keys in a JSON file ({"keys": [...]}), for one machine. Only digests are written, mode 0600.

Every gateway re-reads the file when it changes (one stat per lookup), so a key revoked with
`flotilla keys revoke` is refused at once by every gateway that reads the same file.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from flotilla.tenancy.errors import DuplicateKeyError, UnknownKeyError
from flotilla.tenancy.key_hashing import hash_key
from flotilla.tenancy.key_store import check_unique, entry_from_json, entry_to_json
from flotilla.tenancy.records import Limits, TenantKey


def read_keys_file(path: str | os.PathLike[str]) -> list[TenantKey]:
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"keys file {path}: not valid JSON ({err})") from err
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError(f'keys file {path}: expected {{"keys": [...]}}')
    entries = [entry_from_json(item, f"keys file {path}") for item in document["keys"]]
    check_unique(entries)
    return entries


def write_keys_file(path: str | os.PathLike[str], entries: Iterable[TenantKey]) -> None:
    """Write the keys file atomically (rename), readable by its owner only."""
    path = Path(path)
    entries = list(entries)
    check_unique(entries)
    text = json.dumps({"keys": [entry_to_json(e) for e in entries]}, indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class FileKeyStore:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._by_digest: dict[str, TenantKey] = {}

    async def lookup(self, api_key: str) -> TenantKey | None:
        return self._current().get(hash_key(api_key))

    async def create(self, entry: TenantKey) -> None:
        entries = self._entries()
        if any(e.key_id == entry.key_id for e in entries):
            raise DuplicateKeyError(entry.key_id)
        write_keys_file(self.path, [*entries, entry])

    async def list(self) -> list[TenantKey]:
        return self._entries()

    async def revoke(self, key_id: str) -> bool:
        entries = self._entries()
        kept = [e for e in entries if e.key_id != key_id]
        if len(kept) == len(entries):
            return False
        write_keys_file(self.path, kept)
        return True

    async def set_limits(self, key_id: str, limits: Limits) -> TenantKey:
        entries = self._entries()
        for i, entry in enumerate(entries):
            if entry.key_id == key_id:
                entries[i] = replace(entry, limits=limits)
                write_keys_file(self.path, entries)
                return entries[i]
        raise UnknownKeyError(key_id)

    async def close(self) -> None:
        pass

    def _entries(self) -> list[TenantKey]:
        return read_keys_file(self.path) if self.path.exists() else []

    def _current(self) -> dict[str, TenantKey]:
        """The parsed file, re-read when its inode, size or mtime changed (writes are atomic renames)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return {}
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            with self._lock:
                self._by_digest = {e.sha256: e for e in read_keys_file(self.path)}
                self._stamp = stamp
        return self._by_digest
