"""Idempotency-Key on non-streamed generation requests (an ASGI middleware around the app).

The first request with a key claims it (Redis: a hash with a short lease that the running gateway keeps
renewing) and runs; its answer is stored for `ttl_s` (24 h). A retry with the same key and body gets the
stored answer (header `idempotent-replayed: true`) without running or billing again; a concurrent duplicate
waits for the first; the same key with another body is a 422 in the dialect's error shape. A retryable
answer (429, 5xx, 529, client gone) is not stored: the key is released and the next retry runs. A gateway
that dies mid-request stops renewing its lease, so a retry on another (or the restarted) gateway takes over
once the lease expires. Keys are scoped per API key. Streamed requests ignore the header.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flotilla.gateway.auth import caller_looked_up
from flotilla.gateway.body import decode_json, read_asgi_body
from flotilla.gateway.dialects import dialect_for_path, error_response
from flotilla.gateway.errors import ErrorKind, GatewayError

HEADER = "idempotency-key"
GENERATION_PATHS = frozenset({"/v1/messages", "/v1/chat/completions", "/v1/completions"})
# Fixed-batch models (batch_api.py) and batch-job creation (batch_jobs/: a retried create makes one job) too.
IDEMPOTENT_PATHS = GENERATION_PATHS | {"/v1/batch-generate", "/v1/batches", "/v1/messages/batches"}
KEY_PREFIX = "flotilla:idem:"
MAX_KEY_LENGTH = 256
# Final answers; anything else may be retried. Not 401/403: storing its refusals would let anyone without a key
# fill the store with one entry per Idempotency-Key they invent (a caller whose key does not authenticate does
# not reach the store at all: caller_check).
STORED_STATUSES = frozenset({200, 400, 404, 413})
MAX_MEMORY_ENTRIES = 100_000  # the in-process store (no Redis) forgets the oldest beyond this
REPLAYED_HEADERS = frozenset({b"content-type", b"request-id", b"x-request-id"})
CallerCheck = Callable[[Scope], contextlib.AbstractAsyncContextManager[bool]]


@dataclass
class Entry:
    state: str  # "running" or "done"
    fingerprint: str
    owner: str
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


class IdempotencyStore(Protocol):
    async def claim(self, key: str, fingerprint: str, owner: str, lease_s: float) -> Entry | None:
        """None: claimed (run it); else the entry that holds the key."""

    async def renew(self, key: str, owner: str, lease_s: float) -> bool: ...

    async def complete(self, key: str, owner: str, entry: Entry, ttl_s: float) -> bool: ...

    async def release(self, key: str, owner: str) -> None: ...


_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'state', 'running', 'fp', ARGV[1], 'owner', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {}
end
return redis.call('HGETALL', KEYS[1])
"""
_RENEW = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] and redis.call('HGET', KEYS[1], 'state') == 'running' then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_COMPLETE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'status', ARGV[2], 'headers', ARGV[3], 'body', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""
_RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] and redis.call('HGET', KEYS[1], 'state') == 'running' then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisIdempotencyStore:
    """Shared by every gateway; one hash per (API key, Idempotency-Key)."""

    def __init__(self, client):
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)

    async def claim(self, key: str, fingerprint: str, owner: str, lease_s: float) -> Entry | None:
        raw = await self._claim(keys=[key], args=[fingerprint, owner, int(lease_s * 1000)])
        if not raw:
            return None
        fields = dict(zip(raw[::2], raw[1::2]))
        return Entry(fields["state"], fields["fp"], fields["owner"], int(fields.get("status", 0)),
                     _headers_from(fields.get("headers", "[]")), base64.b64decode(fields.get("body", "")))

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        return bool(await self._renew(keys=[key], args=[owner, int(lease_s * 1000)]))

    async def complete(self, key: str, owner: str, entry: Entry, ttl_s: float) -> bool:
        args = [owner, entry.status, _headers_to(entry.headers), base64.b64encode(entry.body).decode(),
                int(ttl_s * 1000)]
        return bool(await self._complete(keys=[key], args=args))

    async def release(self, key: str, owner: str) -> None:
        await self._release(keys=[key], args=[owner])


class MemoryIdempotencyStore:
    """One gateway without Redis (`flotilla up`): the same rules, in this process only."""

    def __init__(self, clock=time.monotonic, max_entries: int = MAX_MEMORY_ENTRIES):
        self._entries: OrderedDict[str, tuple[Entry, float]] = OrderedDict()  # oldest write first
        self._clock = clock
        self._max_entries = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, key: str, value: tuple[Entry, float]) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def _live(self, key: str) -> Entry | None:
        held = self._entries.get(key)
        if held is None or held[1] <= self._clock():
            self._entries.pop(key, None)
            return None
        return held[0]

    async def claim(self, key: str, fingerprint: str, owner: str, lease_s: float) -> Entry | None:
        entry = self._live(key)
        if entry is None:
            self._put(key, (Entry("running", fingerprint, owner), self._clock() + lease_s))
        return entry

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        entry = self._live(key)
        if entry is None or entry.owner != owner or entry.state != "running":
            return False
        self._put(key, (entry, self._clock() + lease_s))
        return True

    async def complete(self, key: str, owner: str, entry: Entry, ttl_s: float) -> bool:
        held = self._live(key)
        if held is None or held.owner != owner:
            return False
        self._put(key, (entry, self._clock() + ttl_s))
        return True

    async def release(self, key: str, owner: str) -> None:
        entry = self._live(key)
        if entry is not None and entry.owner == owner and entry.state == "running":
            del self._entries[key]


def open_store(redis_client) -> IdempotencyStore:
    return RedisIdempotencyStore(redis_client) if redis_client is not None else MemoryIdempotencyStore()


class IdempotencyMiddleware:
    """`caller_check(scope)`: an async context around the request that yields False when the app will refuse the
    caller's credential. Such a request goes to the app (its 401 in the dialect's shape) without touching the
    store: a caller without a key costs no store round trips and no entry (caller_check_for builds it from the
    app's gatekeeper)."""

    def __init__(self, app: ASGIApp, store: IdempotencyStore, ledger=None, ttl_s: float = 24 * 3600.0,
                 lease_s: float = 5.0, max_wait_s: float = 600.0, max_body_bytes: int = 4 * 1024 * 1024,
                 caller_check: CallerCheck | None = None):
        self.app = app
        self.store = store
        self.caller_check = caller_check
        self.ledger = ledger  # flushed before an answer is stored: a replayed answer is always billed
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self.max_wait_s = max_wait_s
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = _idempotency_key(scope)
        if key is None:
            await self.app(scope, receive, send)
            return
        body, complete = await read_asgi_body(receive, self.max_body_bytes)
        replay = _replaying(body, receive)
        if not complete or _is_stream(body):
            await self.app(scope, replay, send)
            return
        if len(key) > MAX_KEY_LENGTH:
            await _error(scope, send, 400, f"Idempotency-Key must be at most {MAX_KEY_LENGTH} characters")
            return
        check = self.caller_check(scope) if self.caller_check is not None else contextlib.nullcontext(True)
        async with check as authenticates:
            if not authenticates:
                await self.app(scope, replay, send)
                return
            await self._once(scope, replay, send, _store_key(scope, key), _fingerprint(scope, body))

    async def _once(self, scope: Scope, receive: Receive, send: Send, key: str, fingerprint: str) -> None:
        owner = uuid.uuid4().hex
        deadline = time.monotonic() + self.max_wait_s
        while True:
            entry = await self.store.claim(key, fingerprint, owner, self.lease_s)
            if entry is None:
                await self._run(scope, receive, send, key, fingerprint, owner)
                return
            if entry.fingerprint != fingerprint:
                await _error(scope, send, 422, "this Idempotency-Key was used with a different request body")
                return
            if entry.state == "done":
                await _replay(send, entry)
                return
            if time.monotonic() > deadline:
                await _error(scope, send, 409, "a request with this Idempotency-Key is still running; retry later")
                return
            await asyncio.sleep(0.05)  # the first is running (or its gateway died: its lease runs out)

    async def _run(self, scope: Scope, receive: Receive, send: Send, key: str, fingerprint: str, owner: str) -> None:
        captured = Entry("done", fingerprint, owner)

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured.status = message["status"]
                captured.headers = [(k, v) for k, v in message.get("headers", []) if k.lower() in REPLAYED_HEADERS]
            elif message["type"] == "http.response.body":
                captured.body += message.get("body", b"")
                if not message.get("more_body", False) and captured.status in STORED_STATUSES:
                    await self._store(key, owner, captured)  # before the client can see it (and retry)
            await send(message)

        renewer = asyncio.create_task(self._renew_forever(key, owner))
        try:
            await self.app(scope, receive, capture)
        finally:
            renewer.cancel()
            await self.store.release(key, owner)  # a no-op once the answer is stored

    async def _store(self, key: str, owner: str, entry: Entry) -> None:
        if self.ledger is not None:
            await self.ledger.flush()
        await self.store.complete(key, owner, entry, self.ttl_s)

    async def _renew_forever(self, key: str, owner: str) -> None:
        while await self.store.renew(key, owner, self.lease_s):
            await asyncio.sleep(self.lease_s / 3)


def caller_check_for(app: ASGIApp) -> CallerCheck:
    """The check of the credential the app's own authenticate will make, against the gatekeeper of `app`
    (create_app's), asked once per request (auth.py's caller_looked_up: the route reuses the answer)."""
    def check(scope: Scope) -> contextlib.AbstractAsyncContextManager[bool]:
        return caller_looked_up(Headers(scope=scope), app.state.gateway.gatekeeper)

    return check


def _idempotency_key(scope: Scope) -> str | None:
    if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in IDEMPOTENT_PATHS:
        return None
    for name, value in scope["headers"]:
        if name == HEADER.encode():
            return value.decode("latin-1").strip() or None
    return None


def _store_key(scope: Scope, key: str) -> str:
    """Scoped by the caller's credential (hashed): two tenants' keys never meet."""
    headers = dict(scope["headers"])
    credential = headers.get(b"x-api-key") or headers.get(b"authorization") or b""
    caller = hashlib.sha256(credential.strip()).hexdigest()[:24]
    return f"{KEY_PREFIX}{caller}:{hashlib.sha256(key.encode()).hexdigest()}"


def _fingerprint(scope: Scope, body: bytes) -> str:
    try:
        canonical = json.dumps(decode_json(body), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:  # not JSON (or too deep): the app refuses it; the raw bytes fingerprint it
        canonical = body
    return hashlib.sha256(scope["path"].encode() + b"\n" + canonical).hexdigest()


def _is_stream(body: bytes) -> bool:
    try:
        parsed = decode_json(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


def _replaying(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # disconnects still reach the app

    return replay


async def _replay(send: Send, entry: Entry) -> None:
    headers = [*entry.headers, (b"content-length", str(len(entry.body)).encode()), (b"idempotent-replayed", b"true")]
    await send({"type": "http.response.start", "status": entry.status, "headers": headers})
    await send({"type": "http.response.body", "body": entry.body})


async def _error(scope: Scope, send: Send, status: int, message: str) -> None:
    response = error_response(dialect_for_path(scope["path"]),
                              GatewayError(ErrorKind.INVALID_REQUEST, message, param="Idempotency-Key"), 1)
    response.status_code = status
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _headers_to(headers: list[tuple[bytes, bytes]]) -> str:
    return json.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers])


def _headers_from(text: str) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(text)]
