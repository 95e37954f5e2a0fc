"""API-key authentication: `x-api-key` (Anthropic style) or `Authorization: Bearer` (OpenAI style)."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers

from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.keys import KeyStore


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    tier: str


ANONYMOUS = Principal(key_id="anonymous", tenant="anonymous", tier="paid")


def api_key_from_headers(headers: Headers) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return None


def authenticate(headers: Headers, key_store: KeyStore | None) -> Principal:
    """The caller's principal; a store of None means authentication is off (local runs)."""
    if key_store is None:
        return ANONYMOUS
    key = api_key_from_headers(headers)
    if key is None:
        raise GatewayError(ErrorKind.AUTHENTICATION, "missing API key: send x-api-key or Authorization: Bearer",
                           code="invalid_api_key")
    entry = key_store.lookup(key)
    if entry is None:
        raise GatewayError(ErrorKind.AUTHENTICATION, "invalid API key", code="invalid_api_key")
    return Principal(entry.key_id, entry.tenant, entry.tier)
