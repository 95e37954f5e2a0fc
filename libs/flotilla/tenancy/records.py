"""What a key resolves to: tenant, tier, default priority class, limits, prefix-cache salt, safety policy."""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("paid", "free")
PRIORITY_CLASSES = ("interactive", "batch")
_HEX_DIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Limits:
    """Per-tenant limits; 0 means unlimited. Tokens are input + output (max_tokens reserved up front)."""

    tokens_per_minute: int = 0
    requests_per_minute: int = 0
    max_concurrent: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def is_unlimited(self) -> bool:
        return not (self.tokens_per_minute or self.requests_per_minute or self.max_concurrent)


@dataclass(frozen=True)
class TenantKey:
    """One API key's record. Only the SHA-256 digest of the key is kept."""

    key_id: str
    sha256: str
    tenant: str
    tier: str = "paid"
    priority_class: str = "interactive"  # the default class; a request header may ask for another
    limits: Limits = field(default_factory=Limits)
    cache_salt: str = ""  # empty: the tenant name salts the prefix cache
    safety_policy: str = ""  # a policy of the gateway's safety config; empty: its default

    def __post_init__(self) -> None:
        for name in ("key_id", "tenant"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.sha256, str) or len(self.sha256) != 64 or not set(self.sha256) <= _HEX_DIGITS:
            raise ValueError(f"key {self.key_id!r}: sha256 must be 64 lower-case hex digits")
        if self.tier not in TIERS:
            raise ValueError(f"key {self.key_id!r}: tier must be one of {TIERS}, got {self.tier!r}")
        if self.priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"key {self.key_id!r}: priority_class must be one of {PRIORITY_CLASSES}, "
                             f"got {self.priority_class!r}")
        if not isinstance(self.safety_policy, str):
            raise ValueError(f"key {self.key_id!r}: safety_policy must be a string, got {self.safety_policy!r}")
        if not isinstance(self.limits, Limits):
            raise ValueError(f"key {self.key_id!r}: limits must be Limits, got {self.limits!r}")

    @property
    def salt(self) -> str:
        return self.cache_salt or self.tenant
