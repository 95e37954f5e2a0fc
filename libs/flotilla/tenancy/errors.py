"""Tenancy errors: a backend that cannot be reached, a key that is unknown to a management command."""

from __future__ import annotations


class BackendUnavailable(Exception):
    """Redis could not be reached (connection refused, timed out, or reset mid-call)."""


class UnknownKeyError(LookupError):
    def __init__(self, key_id: str):
        super().__init__(f"no key with id {key_id!r}")
        self.key_id = key_id


class DuplicateKeyError(ValueError):
    def __init__(self, key_id: str):
        super().__init__(f"a key with id {key_id!r} exists already")
        self.key_id = key_id
