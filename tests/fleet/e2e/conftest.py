"""The real fleet as separate processes (router, worker, gateway) on loopback, with an API key."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine

from flotilla.models.catalog import DEFAULT_MODEL

from tests.support.fleet import Fleet, fleet_config, start_fleet

NUM_KV_BLOCKS = 512


@pytest.fixture(scope="package")
def fleet(tiny_checkpoint: Path, tmp_path_factory) -> Fleet:
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("fleet"),
                          worker_args=["--num-kv-blocks", str(NUM_KV_BLOCKS)])
    with start_fleet(config, keys={"test-key": ("tenant-a", "paid")}) as running:
        yield running


@pytest.fixture(scope="package")
def trained_fleet(trained_checkpoint: Path, tmp_path_factory) -> Fleet:
    """The fleet on the trained default model (SmolLM2-135M-Instruct), for what needs sensible answers."""
    config = fleet_config(trained_checkpoint, tmp_path_factory.mktemp("trained-fleet"), model_name=DEFAULT_MODEL,
                          worker_args=["--num-kv-blocks", "128"])
    with start_fleet(config, keys={"test-key": ("tenant-a", "paid")}) as running:
        yield running


@pytest.fixture(scope="package")
def offline_engine(tiny_checkpoint: Path) -> LLMEngine:
    """The same checkpoint and engine settings in this process: the reference for fleet output."""
    return LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), num_kv_blocks=NUM_KV_BLOCKS))
