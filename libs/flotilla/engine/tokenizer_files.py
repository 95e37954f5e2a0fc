"""The files of a checkpoint that serving a model needs besides its weights: tokenizer, special tokens, chat
templates and generation defaults, as bytes keyed by their path in the checkpoint directory.

Workers read them from their checkpoint and publish them through the router; the gateway builds its tokenizer
from them (Tokenizer.from_files) and so needs no model volume. The digest names one exact set of files: the
router stores and the gateway caches a set once per digest, and a changed template is a new digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

# What Tokenizer.from_files reads; config.json only for its eos/bos ids (generate() falls back to them).
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "chat_template.jinja",
)
EXTRA_TEMPLATES_DIR = "additional_chat_templates"
# A set larger than this is refused rather than shipped around (the largest 2026 tokenizers are ~35 MB).
MAX_TOTAL_BYTES = 256 * 1024 * 1024

TokenizerFiles = Mapping[str, bytes]


def read_tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer files present in a checkpoint directory; tokenizer.json is required."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir / 'tokenizer.json'} not found (only tokenizer.json checkpoints are supported)")
    paths = [model_dir / name for name in TOKENIZER_FILE_NAMES]
    extra_dir = model_dir / EXTRA_TEMPLATES_DIR
    if extra_dir.is_dir():
        paths += sorted(extra_dir.glob("*.jinja"))
    return {path.relative_to(model_dir).as_posix(): path.read_bytes() for path in paths if path.is_file()}


def files_digest(files: TokenizerFiles) -> str:
    """sha256 over names and contents, independent of the mapping's order."""
    digest = hashlib.sha256()
    for name in sorted(files):
        content = files[name]
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    return "sha256:" + digest.hexdigest()


def check_file_names(files: TokenizerFiles) -> None:
    """Refuse names a publisher could use to smuggle anything else in (the set is data, never a path to open)."""
    allowed = set(TOKENIZER_FILE_NAMES)
    for name in files:
        directory, _, base = name.rpartition("/")
        if name in allowed:
            continue
        if directory == EXTRA_TEMPLATES_DIR and base.endswith(".jinja") and base and "/" not in base and base[0] != ".":
            continue
        raise ValueError(f"unexpected tokenizer file {name!r}")
    if "tokenizer.json" not in files:
        raise ValueError("tokenizer files lack tokenizer.json")
    total = sum(len(content) for content in files.values())
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"tokenizer files total {total} bytes, over the {MAX_TOTAL_BYTES} limit")
