"""Key material: random keys shown once, SHA-256 digests stored."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "fl-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    """A new random key, "fl-" followed by 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)
