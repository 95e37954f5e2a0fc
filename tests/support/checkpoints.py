"""Checkpoint fixtures, available to every test through tests/conftest.py.

`tiny_checkpoint` is one tiny llama checkpoint (seed 0) per test session; `checkpoint_factory(**kwargs)`
returns a session-cached checkpoint for any write_checkpoint arguments (architecture="qwen2", seed=1, ...);
`make_checkpoint(tmp_path_factory, **kwargs)` writes a fresh one each call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flotilla.models import write_checkpoint


def make_checkpoint(tmp_path_factory: pytest.TempPathFactory, **kwargs: Any) -> Path:
    """Write a new checkpoint (write_checkpoint arguments as keywords) into a fresh temporary directory."""
    name = "-".join(f"{key}={value}" for key, value in sorted(kwargs.items()) if key != "rope_scaling")
    return write_checkpoint(tmp_path_factory.mktemp(f"ckpt-{name}"[:60] or "ckpt"), **kwargs)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint_factory(**write_checkpoint_kwargs) -> Path, one directory per distinct arguments."""
    made: dict[str, Path] = {}

    def get(**kwargs: Any) -> Path:
        key = repr(sorted(kwargs.items()))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory, **kwargs)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    """A tiny random llama checkpoint (seed 0); treat it as read-only, it is shared by the whole session."""
    return checkpoint_factory(size="tiny", seed=0, architecture="llama")
