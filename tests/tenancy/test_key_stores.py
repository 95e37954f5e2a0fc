"""Key stores (file, Redis): digests only at rest, lookup, revoke, set-limits; the CLI."""

from __future__ import annotations

import json

import pytest
import redis

from flotilla.cli import main as cli_main
from flotilla.tenancy.errors import DuplicateKeyError, UnknownKeyError
from flotilla.tenancy.file_keys import FileKeyStore
from flotilla.tenancy.key_hashing import generate_key, hash_key
from flotilla.tenancy.records import Limits, TenantKey
from flotilla.tenancy.redis_conn import connect
from flotilla.tenancy.redis_keys import RedisKeyStore


@pytest.fixture(params=["file", "redis"])
async def store(request, tmp_path):
    if request.param == "file":
        yield FileKeyStore(tmp_path / "keys.json")
        return
    client = connect(request.getfixturevalue("redis_url"))
    yield RedisKeyStore(client)
    await client.aclose()


async def test_create_lookup_revoke(store):
    key = generate_key()
    entry = TenantKey("k1", hash_key(key), "acme", "free", "batch", Limits(1000, 10, 2), "salt-1", "strict")
    await store.create(entry)
    assert await store.lookup(key) == entry
    assert await store.lookup(key + "x") is None
    with pytest.raises(DuplicateKeyError):
        await store.create(TenantKey("k1", hash_key(generate_key()), "acme"))
    updated = await store.set_limits("k1", Limits(tokens_per_minute=5))
    assert (await store.lookup(key)).limits == Limits(tokens_per_minute=5) == updated.limits
    assert [e.key_id for e in await store.list()] == ["k1"]
    assert await store.revoke("k1") and not await store.revoke("k1")
    assert await store.lookup(key) is None
    with pytest.raises(UnknownKeyError):
        await store.set_limits("k1", Limits())


def _redis_dump(url: str) -> str:
    client = redis.Redis.from_url(url, decode_responses=True)
    parts = []
    for name in client.keys("*"):
        parts.append(f"{name}={client.hgetall(name) if client.type(name) == 'hash' else client.get(name)}")
    client.close()
    return "\n".join(parts)


def test_cli_manages_keys_in_redis_and_never_stores_plaintext(redis_url, capsys):
    assert cli_main(["keys", "create", "--redis-url", redis_url, "--key-id", "k1", "--tenant", "acme",
                     "--tier", "free", "--priority-class", "batch", "--tokens-per-minute", "5000",
                     "--safety-policy", "strict"]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert key.startswith("fl-")
    dump = _redis_dump(redis_url)
    assert key not in dump and hash_key(key) in dump
    assert cli_main(["keys", "set-limits", "--redis-url", redis_url, "k1", "--requests-per-minute", "7"]) == 0
    assert cli_main(["keys", "list", "--redis-url", redis_url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert listed[0]["key_id"] == "k1" and listed[0]["limits"]["requests_per_minute"] == 7
    assert listed[0]["limits"]["tokens_per_minute"] == 5000 and listed[0]["tier"] == "free"
    assert listed[0]["safety_policy"] == "strict"
    assert "sha256" not in listed[0]
    assert cli_main(["keys", "revoke", "--redis-url", redis_url, "k1"]) == 0
    assert cli_main(["keys", "revoke", "--redis-url", redis_url, "k1"]) == 1


def test_cli_file_backend(tmp_path, capsys):
    path = tmp_path / "keys.json"
    assert cli_main(["keys", "create", "--keys-file", str(path), "--key-id", "k1", "--tenant", "acme"]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert key not in path.read_text() and hash_key(key) in path.read_text()
    assert cli_main(["keys", "revoke", "--keys-file", str(path), "k1"]) == 0
    assert json.loads(path.read_text())["keys"] == []
