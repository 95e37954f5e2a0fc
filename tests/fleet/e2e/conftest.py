"""The real fleet as separate processes (router, worker, gateway) on loopback, with an API key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2
from flotilla.api.worker.v1 import worker_pb2, worker_pb2_grpc
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.fleet.local import FleetConfig, LocalFleet
from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file

MODEL_NAME = "flotilla-tiny"
NUM_KV_BLOCKS = 512


@dataclass
class RunningFleet:
    fleet: LocalFleet
    base_url: str
    api_key: str
    model: str

    def worker_load(self, index: int = 0) -> common_pb2.LoadReport:
        with grpc.insecure_channel(self.fleet.workers[index].address) as channel:
            return worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


@pytest.fixture(scope="package")
def fleet(tiny_checkpoint: Path, tmp_path_factory) -> RunningFleet:
    state_dir = tmp_path_factory.mktemp("fleet")
    api_key = generate_key()
    keys_file = state_dir / "keys.json"
    write_keys_file(keys_file, [KeyEntry("test-key", hash_key(api_key), "tenant-a", "paid")])
    config = FleetConfig(
        model_dir=tiny_checkpoint,
        state_dir=state_dir,
        model_name=MODEL_NAME,
        keys_file=keys_file,
        worker_args=["--num-kv-blocks", str(NUM_KV_BLOCKS)],
    )
    with LocalFleet(config) as local_fleet:
        yield RunningFleet(local_fleet, local_fleet.gateway_url, api_key, MODEL_NAME)


@pytest.fixture(scope="package")
def offline_engine(tiny_checkpoint: Path) -> LLMEngine:
    """The same checkpoint and engine settings in this process: the reference for fleet output."""
    return LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), num_kv_blocks=NUM_KV_BLOCKS))
