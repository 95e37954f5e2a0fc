"""API-key authentication: `x-api-key` (Anthropic style) or `Authorization: Bearer` (OpenAI style).

The key resolves (through the tenancy gatekeeper: keys file or Redis) to a tenant, tier, default priority
class, limits and prefix-cache salt. A request may ask for another class with `x-flotilla-priority`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.datastructures import Headers

from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.tenancy.errors import BackendUnavailable
from flotilla.tenancy.gatekeeper import Gatekeeper
from flotilla.tenancy.records import PRIORITY_CLASSES, Limits, TenantKey

PRIORITY_HEADER = "x-flotilla-priority"
# What HTTP strips around a field value (RFC 9110's OWS). str.strip() also strips a latin-1 no-break space or NEL,
# which would make " batch" with a 0xA0 in front a class.
HTTP_WHITESPACE = " \t"


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant: str
    tier: str
    priority_class: str = "interactive"
    limits: Limits = field(default_factory=Limits)
    cache_salt: str = ""
    batch_item: tuple[str, int] | None = None  # (job id, item index) of a batch-job item (batch_jobs/)
    safety_policy: str = ""  # "": the gateway's default safety policy
    # What its tokens are charged, as a fraction (usage/pricing.py): 1, or a batch item's batch rate (set by the
    # runner, never from a request)
    price_factor: float = 1.0

    @property
    def salt(self) -> str:
        return self.cache_salt or self.tenant


ANONYMOUS = Principal(key_id="anonymous", tenant="anonymous", tier="paid")
# The key store's answer for this request's key, when a middleware asked it first (idempotency.py checks the
# caller before it claims an Idempotency-Key): the route's authenticate reuses it instead of asking again. Set
# around that request's app call only (caller_looked_up).
_LOOKED_UP: ContextVar[tuple[str, TenantKey | None] | None] = ContextVar("flotilla_looked_up_key", default=None)
# Set only around the gateway's own in-process calls (batch_jobs/dispatch.py); a client's request runs in a
# server task where it is unset, so no header can claim it.
_ACTING_AS: ContextVar[Principal | None] = ContextVar("flotilla_acting_as", default=None)


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Requests made inside this block authenticate as `principal`, whatever their headers."""
    token = _ACTING_AS.set(principal)
    try:
        yield
    finally:
        _ACTING_AS.reset(token)


def api_key_from_headers(headers: Headers) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return None


async def authenticate(headers: Headers, gatekeeper: Gatekeeper | None) -> Principal:
    """The caller's principal; a gatekeeper of None means authentication is off (local runs)."""
    internal = _ACTING_AS.get()
    if internal is not None:
        return internal
    priority = _requested_priority(headers)
    if gatekeeper is None:
        return ANONYMOUS if priority is None else Principal("anonymous", "anonymous", "paid", priority)
    key = api_key_from_headers(headers)
    if key is None:
        raise GatewayError(ErrorKind.AUTHENTICATION, "missing API key: send x-api-key or Authorization: Bearer",
                           code="invalid_api_key")
    try:
        entry = await _look_up(gatekeeper, key)
    except BackendUnavailable as err:
        raise GatewayError(ErrorKind.UNAVAILABLE, "the key store is unavailable; retry later",
                           code="unavailable") from err
    if entry is None:
        raise GatewayError(ErrorKind.AUTHENTICATION, "invalid API key", code="invalid_api_key")
    if priority is not None and _rank(priority) < _rank(entry.priority_class):
        # A batch key asking to be served as interactive would jump the queue it was given.
        raise GatewayError(ErrorKind.PERMISSION, f"this key's priority class is {entry.priority_class}: "
                           f"{PRIORITY_HEADER} may only lower it", param=PRIORITY_HEADER, code="permission_denied")
    return Principal(entry.key_id, entry.tenant, entry.tier, priority or entry.priority_class, entry.limits,
                     entry.cache_salt, safety_policy=entry.safety_policy)


@contextlib.asynccontextmanager
async def caller_looked_up(headers: Headers, gatekeeper: Gatekeeper | None) -> AsyncIterator[bool]:
    """Yields False when authenticate would refuse the caller's key (none, or unknown), True otherwise, also when
    the key store cannot answer (authenticate then answers 503). Inside the block authenticate reuses the key
    store's answer; it is forgotten when the block ends (an in-process caller may send several requests from one
    task, and a key revoked in between must not pass)."""
    if gatekeeper is None or _ACTING_AS.get() is not None:
        yield True
        return
    key = api_key_from_headers(headers)
    if key is None:
        yield False
        return
    try:
        entry = await gatekeeper.authenticate(key)
    except BackendUnavailable:
        yield True
        return
    token = _LOOKED_UP.set((key, entry))
    try:
        yield entry is not None
    finally:
        _LOOKED_UP.reset(token)


async def _look_up(gatekeeper: Gatekeeper, key: str) -> TenantKey | None:
    looked_up = _LOOKED_UP.get()
    if looked_up is not None and looked_up[0] == key:
        return looked_up[1]
    return await gatekeeper.authenticate(key)


def _rank(priority_class: str) -> int:
    """0 is served first (PRIORITY_CLASSES is in that order)."""
    return PRIORITY_CLASSES.index(priority_class)


def _requested_priority(headers: Headers) -> str | None:
    value = headers.get(PRIORITY_HEADER)
    if value is None:
        return None
    value = value.strip(HTTP_WHITESPACE).lower()
    if value not in PRIORITY_CLASSES:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{PRIORITY_HEADER} must be one of {PRIORITY_CLASSES}",
                           param=PRIORITY_HEADER)
    return value
