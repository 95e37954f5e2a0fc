from __future__ import annotations

import json
import os
import stat

import pytest

from flotilla.cli import main as cli_main
from flotilla.tenancy.keys import KeyEntry, KeyStore, generate_key, hash_key, write_keys_file


def test_generated_keys_are_distinct_and_prefixed():
    keys = {generate_key() for _ in range(20)}
    assert len(keys) == 20 and all(k.startswith("fl-") and len(k) > 40 for k in keys)


def test_round_trip_stores_digests_only(tmp_path):
    key = generate_key()
    path = tmp_path / "keys.json"
    write_keys_file(path, [KeyEntry("k1", hash_key(key), "acme", "paid")])

    assert key not in path.read_text()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    store = KeyStore.from_file(path)
    assert store.lookup(key) == KeyEntry("k1", hash_key(key), "acme", "paid")
    assert store.lookup(key + "x") is None and store.lookup("") is None


@pytest.mark.parametrize("entry", [
    {"key_id": "k", "sha256": "abc", "tenant": "t", "tier": "paid"},  # not a digest
    {"key_id": "k", "sha256": "0" * 64, "tenant": "t", "tier": "gold"},  # unknown tier
    {"key_id": "", "sha256": "0" * 64, "tenant": "t", "tier": "paid"},
    {"key_id": "k", "sha256": "0" * 64, "tenant": "t", "tier": "paid", "key": "plaintext"},  # extra field
])
def test_invalid_entries_are_refused(tmp_path, entry):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [entry]}))
    with pytest.raises(ValueError):
        KeyStore.from_file(path)


def test_duplicate_digests_are_refused():
    digest = hash_key("same")
    with pytest.raises(ValueError, match="duplicate"):
        KeyStore([KeyEntry("a", digest, "t", "paid"), KeyEntry("b", digest, "t", "free")])


def test_cli_adds_a_key_and_prints_it_once(tmp_path, capsys):
    path = tmp_path / "keys.json"
    assert cli_main(["gateway-key", "--keys-file", str(path), "--key-id", "k1", "--tenant", "acme"]) == 0
    assert cli_main(["gateway-key", "--keys-file", str(path), "--key-id", "k2", "--tenant", "b", "--tier", "free"]) == 0
    first, second = capsys.readouterr().out.split()
    store = KeyStore.from_file(path)
    assert store.lookup(first).tenant == "acme" and store.lookup(second).tier == "free"
