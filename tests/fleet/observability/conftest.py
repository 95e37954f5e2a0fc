"""One real fleet (router, worker, gateway as processes) exporting traces over OTLP/HTTP to a receiver in
the test, with its router and worker serving /metrics on free ports. Two API keys: the Prometheus test
sends as the `paid` tier and the trace tests as the `free` tier, so neither counts the other's requests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from flotilla.fleet.local import FleetConfig, LocalFleet
from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file

from tests.support.otlp_receiver import OTLPReceiver

MODEL_NAME = "flotilla-tiny"


@dataclass
class ObservedFleet:
    fleet: LocalFleet
    receiver: OTLPReceiver
    paid_key: str
    free_key: str
    state_dir: Path

    @property
    def base_url(self) -> str:
        return self.fleet.gateway_url


@pytest.fixture(scope="package")
def otlp_receiver():
    receiver = OTLPReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def observed_fleet(tiny_checkpoint: Path, tmp_path_factory, otlp_receiver: OTLPReceiver) -> ObservedFleet:
    state_dir = tmp_path_factory.mktemp("observed-fleet")
    paid_key, free_key = generate_key(), generate_key()
    keys_file = state_dir / "keys.json"
    write_keys_file(keys_file, [KeyEntry("k-paid", hash_key(paid_key), "acme", "paid"),
                                KeyEntry("k-free", hash_key(free_key), "hobbyist", "free")])
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    config = FleetConfig(model_dir=tiny_checkpoint, state_dir=state_dir, model_name=MODEL_NAME,
                         keys_file=keys_file, worker_args=["--num-kv-blocks", "128"], env=env)
    with LocalFleet(config) as fleet:
        yield ObservedFleet(fleet, otlp_receiver, paid_key, free_key, state_dir)
