"""A random-weight checkpoint made once per size and reused, and its parameter count read from the files."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from flotilla.models.checkpoint import write_checkpoint

CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
EMBEDDING_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "flotilla" / "bench"


def ensure_checkpoint(cache_dir: Path, size: str, seed: int = 0) -> Path:
    """The cached checkpoint of this size and seed, written first if missing. Written into a temporary
    folder and renamed into place, so an interrupted run never leaves a half-written checkpoint behind."""
    target = cache_dir / f"{size}-seed{seed}"
    if all((target / name).is_file() for name in CHECKPOINT_FILES):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{size}-", dir=cache_dir))
    try:
        write_checkpoint(staging, size=size, seed=seed)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a .safetensors header (8-byte little-endian length, then JSON), without loading."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def count_parameters(model_dir: Path) -> int:
    """Every weight in the checkpoint, with the vocabulary matrix counted once: a tied checkpoint stores
    only the embedding; an untied one stores the embedding and lm_head, and only lm_head does a matmul
    (the embedding is a lookup), so the embedding is left out then."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        shapes.update(safetensors_shapes(path))
    if not shapes:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    if LM_HEAD_NAME in shapes:
        shapes.pop(EMBEDDING_NAME, None)
    total = 0
    for dims in shapes.values():
        count = 1
        for dim in dims:
            count *= dim
        total += count
    return total
