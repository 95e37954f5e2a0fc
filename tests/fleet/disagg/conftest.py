"""Fixtures: a disaggregated fleet (1 prefill + 2 decode workers) and the colocated reference engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from flotilla.engine.engine import LLMEngine
from flotilla.fleet.local import LocalFleet

from .fleet_helpers import fleet_config, reference_engine
from tests.support.otlp_receiver import OTLPReceiver


@dataclass
class DisaggFleet:
    fleet: LocalFleet
    base_url: str
    spans: OTLPReceiver | None = None  # what the processes exported over OTLP (the module fleet only)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> LLMEngine:
    return reference_engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def disagg_fleet(tiny_checkpoint: Path, tmp_path_factory) -> DisaggFleet:
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("disagg"), num_prefill=1, num_decode=2)
    receiver = OTLPReceiver().start()
    config.env = {**config.env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        with LocalFleet(config) as fleet:
            yield DisaggFleet(fleet, fleet.gateway_url, receiver)
    finally:
        receiver.stop()
