"""Checkpoints built once per test session (tiny, random, saved with transformers itself)."""

from __future__ import annotations

import pytest
import torch

from .helpers import make_checkpoint
from flotilla.engine.model import load_model


class Checkpoint:
    def __init__(self, directory, hf_model) -> None:
        self.directory = directory
        self.hf = hf_model
        self.model = load_model(directory, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache: dict[str, Checkpoint] = {}

    def get(kind: str) -> Checkpoint:
        if kind not in cache:
            directory = tmp_path_factory.mktemp(kind)
            cache[kind] = Checkpoint(directory, make_checkpoint(directory, kind))
        return cache[kind]

    return get


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on shared CPU cores: intra-op threads only contend (10x slower here), so use one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
