"""API keys: only SHA-256 digests are stored; a key resolves to its tenant and tier.

Keys file (JSON): {"keys": [{"key_id": "...", "sha256": "<hex digest of the key>", "tenant": "...",
"tier": "paid"|"free"}]}. Plaintext keys are shown once, when generated, and never written.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

TIERS = ("paid", "free")
KEY_PREFIX = "fl-"
_HEX_DIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class KeyEntry:
    key_id: str
    sha256: str
    tenant: str
    tier: str

    def __post_init__(self) -> None:
        for name in ("key_id", "tenant"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.sha256, str) or len(self.sha256) != 64 or not set(self.sha256) <= _HEX_DIGITS:
            raise ValueError(f"key {self.key_id!r}: sha256 must be 64 lower-case hex digits")
        if self.tier not in TIERS:
            raise ValueError(f"key {self.key_id!r}: tier must be one of {TIERS}, got {self.tier!r}")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    """A new random key, "fl-" followed by 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def write_keys_file(path: str | os.PathLike[str], entries: Iterable[KeyEntry]) -> None:
    """Write the keys file atomically, readable by its owner only."""
    path = Path(path)
    entries = list(entries)
    _check_unique(entries)
    text = json.dumps({"keys": [asdict(e) for e in entries]}, indent=2) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class KeyStore:
    """Looks keys up by digest, so plaintext never needs to be kept."""

    def __init__(self, entries: Iterable[KeyEntry]):
        self.entries = list(entries)
        _check_unique(self.entries)
        self._by_digest = {e.sha256: e for e in self.entries}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyStore:
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"keys file {path}: not valid JSON ({err})") from err
        if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
            raise ValueError(f'keys file {path}: expected {{"keys": [...]}}')
        return cls(_entry_from_json(item, path) for item in document["keys"])

    def lookup(self, key: str) -> KeyEntry | None:
        return self._by_digest.get(hash_key(key))

    def __len__(self) -> int:
        return len(self.entries)


def _entry_from_json(item: object, path: object) -> KeyEntry:
    fields = ("key_id", "sha256", "tenant", "tier")
    if not isinstance(item, dict) or set(item) != set(fields):
        raise ValueError(f"keys file {path}: each key needs exactly the fields {fields}, got {item!r}")
    return KeyEntry(**item)


def _check_unique(entries: list[KeyEntry]) -> None:
    for attr in ("key_id", "sha256"):
        values = [getattr(e, attr) for e in entries]
        if len(values) != len(set(values)):
            raise ValueError(f"duplicate {attr} in keys")
