"""Chained, stable hashes of full KV blocks: the keys of the prefix cache.

A block's hash covers its parent's hash, its tokens and the request's cache salt (the tenant), so equal
hashes mean equal whole prefixes under the same salt. blake2b over a fixed binary encoding gives the
same bytes in every process (Python's `hash()` is salted per process, so a router could not compare it).
Only full blocks are hashed: a partial block's content is still growing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 32
_PERSON = b"flotilla-kv-v1"  # domain separation: these digests mean nothing outside the prefix cache
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], salt: str) -> bytes:
    """Hash one full block given the hash of the block before it (None for the first block)."""
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON)
    if parent_hash is None:
        digest.update(_NO_PARENT)
    else:
        digest.update(_HAS_PARENT + parent_hash)
    salt_bytes = salt.encode("utf-8")
    # Length prefixes keep the encoding unambiguous (salt "a" + tokens vs salt "" + other bytes).
    digest.update(struct.pack("<I", len(salt_bytes)) + salt_bytes)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return digest.digest()


def chain_root(key: str | None) -> bytes | None:
    """A digest to start a request's chain from instead of no parent, for K/V that depend on more than the
    tokens and the salt (`key`; None: nothing more). A chain from a root never equals one without: the first
    block hash encodes "has a parent" and the root's bytes."""
    if key is None:
        return None
    return hashlib.blake2b(key.encode("utf-8"), digest_size=DIGEST_SIZE, person=b"flotilla-root-v1").digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str,
    parent_hash: bytes | None = None,
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`; a trailing partial block is
    skipped. Pass the last known hash as `parent_hash` to extend a chain with later blocks."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size], salt)
        hashes.append(parent_hash)
    return hashes
