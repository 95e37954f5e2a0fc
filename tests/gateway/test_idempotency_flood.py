"""10,000 unauthenticated Idempotency-Keys through the real app with the in-process idempotency store (the one a
gateway without Redis uses): every one is a 401 and the store holds none of them. (The same with the Redis store,
through the gateway process: tests/fleet/faults/test_client_retries.py.)"""

from __future__ import annotations

import orjson

from flotilla.gateway.app import create_app
from flotilla.gateway.idempotency import IdempotencyMiddleware, MemoryIdempotencyStore
from flotilla.gateway.settings import GatewaySettings
from flotilla.tenancy.keys import KeyEntry, KeyStore, generate_key, hash_key, write_keys_file

NUM_KEYS = 10_000
BODY = orjson.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})


async def test_unauthenticated_idempotency_keys_leave_the_memory_store_empty(tmp_path):
    keys_file = tmp_path / "keys.json"
    write_keys_file(keys_file, [KeyEntry("k", hash_key(generate_key()), "acme", "paid")])
    app = create_app(GatewaySettings(keys_file=keys_file), backend=None, key_store=KeyStore.from_file(keys_file))
    store = MemoryIdempotencyStore()
    app.add_middleware(IdempotencyMiddleware, store=store, max_body_bytes=64 * 1024)
    statuses = [await _post(app, "/v1/messages" if i % 3 == 0 else "/v1/chat/completions",
                            [(b"idempotency-key", f"anon-{i}".encode()),
                             *([(b"x-api-key", f"fl-guess-{i}".encode())] if i % 2 else [])])
                for i in range(NUM_KEYS)]
    assert set(statuses) == {401}
    assert len(store) == 0


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
