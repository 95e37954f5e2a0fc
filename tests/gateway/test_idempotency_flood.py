"""10,000 unauthenticated Idempotency-Keys through the real app with the in-process idempotency store (the one a
gateway without Redis uses), the middleware set up as the gateway sets it up: every one is a 401, the store was
never asked (no claim, no entry), and a request with a valid key asks the key store once. (The Redis store,
through the gateway process: tests/fleet/faults/test_client_retries.py.)"""

from __future__ import annotations

import orjson

from flotilla.gateway.app import create_app
from flotilla.gateway.idempotency import IdempotencyMiddleware, MemoryIdempotencyStore, caller_check_for
from flotilla.gateway.settings import GatewaySettings
from flotilla.tenancy.keys import KeyEntry, KeyStore, generate_key, hash_key, write_keys_file

NUM_KEYS = 10_000
BODY = orjson.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})


class CountingStore(MemoryIdempotencyStore):
    def __init__(self):
        super().__init__()
        self.claims = 0

    async def claim(self, key, fingerprint, owner, lease_s):
        self.claims += 1
        return await super().claim(key, fingerprint, owner, lease_s)


async def test_unauthenticated_idempotency_keys_never_reach_the_memory_store(tmp_path):
    keys_file = tmp_path / "keys.json"
    valid_key = generate_key()
    write_keys_file(keys_file, [KeyEntry("k", hash_key(valid_key), "acme", "paid")])
    app = create_app(GatewaySettings(keys_file=keys_file), backend=None, key_store=KeyStore.from_file(keys_file))
    store = CountingStore()
    app.add_middleware(IdempotencyMiddleware, store=store, max_body_bytes=64 * 1024,
                       caller_check=caller_check_for(app))  # as the gateway sets it up (fault_tolerance.py)
    statuses = [await _post(app, "/v1/messages" if i % 3 == 0 else "/v1/chat/completions",
                            [(b"idempotency-key", f"anon-{i}".encode()),
                             *([(b"x-api-key", f"fl-guess-{i}".encode())] if i % 2 else [])])
                for i in range(NUM_KEYS)]
    assert set(statuses) == {401}
    assert store.claims == 0 and len(store) == 0

    gatekeeper = app.state.gateway.gatekeeper
    lookups = []
    authenticate = gatekeeper.authenticate

    async def counted(key):
        lookups.append(key)
        return await authenticate(key)

    gatekeeper.authenticate = counted
    status = await _post(app, "/v1/messages", [(b"idempotency-key", b"known"), (b"x-api-key", valid_key.encode())])
    assert status != 401 and store.claims == 1  # authenticated: the key is claimed (no backend here: not a 200)
    assert lookups == [valid_key]  # the middleware's answer served the route's authenticate too
    await _post(app, "/v1/messages", [(b"x-api-key", valid_key.encode())])  # no Idempotency-Key: only the route asks
    assert lookups == [valid_key] * 2  # the answer was forgotten after its request, though this one ran in its task


async def _post(app, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """One request straight through the ASGI app (an HTTP client per request would cost 10x the app's time)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("gateway", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"content-type", b"application/json"), *headers]}
    messages = [{"type": "http.request", "body": BODY, "more_body": False}]
    status = 0

    async def receive() -> dict:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status
