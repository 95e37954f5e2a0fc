"""A shared-pool worker's catalog: the checkpoint directories it may load (`--shared-models NAME=DIR,...`).

What the router needs to list and resolve a model (name, version digest, context window, tokenizer digest) is
read from each directory at start-up without loading any weights, so the worker advertises all of them at once
and loads one only when a request needs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.engine import model_version
from flotilla.engine.model.loader import check_checkpoint
from flotilla.engine.tokenizer_files import files_digest, read_tokenizer_files


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    model_dir: str
    info: pb.ModelInfo
    tokenizer_files: dict[str, bytes]

    @property
    def qualified(self) -> str:
        return f"{self.name}@{self.info.version}"


def parse_shared_models(spec: str) -> list[tuple[str, str]]:
    """`NAME=DIR,DIR,...` -> [(name, dir)]; a bare DIR is named after its directory. Raises ValueError."""
    pairs = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, sep, model_dir = item.partition("=")
        if not sep:
            name, model_dir = Path(item).resolve().name, item
        if not name or not model_dir:
            raise ValueError(f"--shared-models expects NAME=DIR or DIR items, got {item!r}")
        pairs.append((name, model_dir))
    names = [name for name, _ in pairs]
    if not pairs or len(set(names)) != len(names):
        raise ValueError(f"--shared-models needs at least one model and distinct names, got {names}")
    return pairs


def read_catalog(pairs: Iterable[tuple[str, str]], max_model_len: int | None = None) -> dict[str, CatalogEntry]:
    """name -> entry, in the given order. Raises ValueError for a checkpoint the engine cannot load."""
    catalog = {}
    for name, model_dir in pairs:
        config = check_checkpoint(model_dir)
        files = read_tokenizer_files(model_dir)
        context = min(config.max_model_len, max_model_len or 1 << 62)
        info = pb.ModelInfo(name=name, version=model_version(model_dir), max_model_len=context,
                            assets_digest=files_digest(files))
        catalog[name] = CatalogEntry(name, str(model_dir), info, files)
    return catalog


def find_entry(catalog: dict[str, CatalogEntry], requested: str) -> CatalogEntry | None:
    """The entry for `name` or `name@version` (None when not served here, or another version)."""
    name, sep, version = requested.partition("@")
    entry = catalog.get(name)
    if entry is None or (sep and version != entry.info.version):
        return None
    return entry
