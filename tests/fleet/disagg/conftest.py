"""Fixtures: a disaggregated fleet (1 prefill + 2 decode workers, its traces exported to Fleet.spans) and the
colocated reference engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.engine.engine import LLMEngine

from tests.support.fleet import Fleet, start_fleet

from .fleet_helpers import fleet_config, reference_engine


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> LLMEngine:
    return reference_engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def disagg_fleet(tiny_checkpoint: Path, tmp_path_factory) -> Fleet:
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("disagg"), num_prefill=1, num_decode=2)
    with start_fleet(config, otlp=True) as fleet:
        yield fleet
