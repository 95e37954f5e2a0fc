"""The key store interface both backends (JSON file, Redis) implement.

Contract: `lookup` takes the plaintext key from a request, hashes it and returns its record or None; a
revoked key is gone from the store, so the next lookup on any gateway returns None. Backends raise
BackendUnavailable when their storage cannot be reached, never a driver-specific error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from flotilla.tenancy.records import Limits, TenantKey

OPTIONAL_FIELDS = ("priority_class", "limits", "cache_salt", "safety_policy")
REQUIRED_FIELDS = ("key_id", "sha256", "tenant", "tier")


class KeyStore(Protocol):
    async def lookup(self, api_key: str) -> TenantKey | None: ...

    async def create(self, entry: TenantKey) -> None: ...

    async def list(self) -> list[TenantKey]: ...

    async def revoke(self, key_id: str) -> bool: ...

    async def set_limits(self, key_id: str, limits: Limits) -> TenantKey: ...

    async def close(self) -> None: ...


def entry_to_json(entry: TenantKey) -> dict[str, Any]:
    return {"key_id": entry.key_id, "sha256": entry.sha256, "tenant": entry.tenant, "tier": entry.tier,
            "priority_class": entry.priority_class, "cache_salt": entry.cache_salt,
            "safety_policy": entry.safety_policy,
            "limits": {"tokens_per_minute": entry.limits.tokens_per_minute,
                       "requests_per_minute": entry.limits.requests_per_minute,
                       "max_concurrent": entry.limits.max_concurrent}}


def entry_from_json(item: object, where: object) -> TenantKey:
    """A record from its JSON form; unknown fields (a plaintext "key", say) are refused."""
    if not isinstance(item, Mapping) or not set(REQUIRED_FIELDS) <= set(item) \
            or not set(item) <= {*REQUIRED_FIELDS, *OPTIONAL_FIELDS}:
        raise ValueError(f"{where}: each key needs the fields {REQUIRED_FIELDS} (optional: {OPTIONAL_FIELDS}), "
                         f"got {item!r}")
    fields = dict(item)
    limits = fields.pop("limits", None) or {}
    if not isinstance(limits, Mapping):
        raise ValueError(f"{where}: limits must be an object, got {limits!r}")
    try:
        return TenantKey(**fields, limits=Limits(**limits))
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from err


def check_unique(entries: Iterable[TenantKey]) -> None:
    entries = list(entries)
    for attr in ("key_id", "sha256"):
        values = [getattr(e, attr) for e in entries]
        if len(values) != len(set(values)):
            raise ValueError(f"duplicate {attr} in keys")
