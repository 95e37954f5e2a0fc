"""A shared-pool worker's catalog: `--shared-models` parsing, and what it advertises of each checkpoint without
loading it (the same version digest and tokenizer digest a one-model worker of that checkpoint reports); the GPU
KV budget of one load slot."""

from __future__ import annotations

import pytest

from flotilla.engine.engine import model_version
from flotilla.engine.tokenizer_files import files_digest, read_tokenizer_files
from flotilla.worker.shared_catalog import find_entry, parse_shared_models, read_catalog
from flotilla.worker.shared_memory import DoesNotFitError, checkpoint_bytes, slot_kv_budget


def test_parse_names_and_bare_directories():
    assert parse_shared_models("a=/m/a, /m/b-model ,") == [("a", "/m/a"), ("b-model", "/m/b-model")]
    for bad in ("", "a=/m/a,a=/m/b", "=/m/a", "a="):
        with pytest.raises(ValueError):
            parse_shared_models(bad)


def test_catalog_advertises_each_checkpoint_without_loading_it(checkpoint_factory):
    a, b = checkpoint_factory(size="tiny", seed=21), checkpoint_factory(size="tiny", seed=22, architecture="qwen2")
    catalog = read_catalog([("rare-a", str(a)), ("rare-b", str(b))], max_model_len=64)
    assert list(catalog) == ["rare-a", "rare-b"]
    entry = catalog["rare-a"]
    assert entry.info.version == model_version(a) != catalog["rare-b"].info.version
    assert entry.info.assets_digest == files_digest(read_tokenizer_files(a)) and entry.info.max_model_len == 64
    assert find_entry(catalog, "rare-a") is entry and find_entry(catalog, entry.qualified) is entry
    assert find_entry(catalog, "rare-a@other") is None and find_entry(catalog, "nope") is None


def test_each_slot_gets_an_equal_share_less_its_weights(checkpoint_factory):
    gib = 1 << 30
    assert slot_kv_budget(100 * gib, 2, 10 * gib, fraction=0.8) == 30 * gib  # 40 GiB a slot, 10 of them weights
    assert slot_kv_budget(100 * gib, 1, 10 * gib, 2 * gib, fraction=0.8) == 68 * gib
    with pytest.raises(DoesNotFitError, match="--max-loaded-models"):
        slot_kv_budget(100 * gib, 4, 20 * gib, 2 * gib, fraction=0.8)
    tiny = checkpoint_factory(size="tiny", seed=21)
    assert checkpoint_bytes(tiny) == (tiny / "model.safetensors").stat().st_size > 0
