"""Disaggregated fleets for tests (real router, gateway, prefill and decode worker processes on loopback, started
with tests/support/fleet.py) and what the disaggregation tests read from their workers: KV state, KV bytes."""

from __future__ import annotations

from pathlib import Path

import grpc

from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2_grpc
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.fleet.local import FleetConfig, LocalFleet
from flotilla.fleet.process import ServiceProcess

from tests.support import fleet as support_fleet
from tests.support.fleet import MODEL, metric_samples  # noqa: F401  (MODEL: for the tests)
from tests.support.tls import channel
from tests.support.waiting import wait_until

# The disaggregation tests' short names for the shared helpers.
from tests.support.fleet import worker_load as load  # noqa: F401
from tests.support.waiting import wait_until as until  # noqa: F401

NUM_KV_BLOCKS = 512
MAX_BATCHED_TOKENS = 128  # prompts over this are prefilled in chunks: one round of layer writes per chunk


def fleet_config(checkpoint: Path, state_dir: Path, num_prefill: int, num_decode: int, *extra: str) -> FleetConfig:
    return support_fleet.fleet_config(
        checkpoint,
        state_dir,
        num_workers=0,
        num_prefill_workers=num_prefill,
        num_decode_workers=num_decode,
        worker_args=["--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
                     "--min-remote-prefill-tokens", "16", *extra],  # fmt: skip
        metrics=True,  # workers' /metrics carry the KV transfer figures (kv_transfer_bytes)
    )


def reference_engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(checkpoint), num_kv_blocks=NUM_KV_BLOCKS,
                                  max_num_batched_tokens=MAX_BATCHED_TOKENS))  # fmt: skip


def kv_state(worker: ServiceProcess) -> kpb.KVState:
    with channel(worker.address, "worker", client_role="operator") as worker_channel:
        return kv_transfer_pb2_grpc.KVTransferServiceStub(worker_channel).GetKVState(kpb.GetKVStateRequest(),
                                                                                     timeout=10)


def workers_with_role(fleet: LocalFleet, role: str) -> list[ServiceProcess]:
    return [w for w in fleet.workers if w.is_running() and ["--role", role] == _role_args(w)]


def _role_args(worker: ServiceProcess) -> list[str]:
    args = list(worker.args)
    index = len(args) - 1 - args[::-1].index("--role")
    return args[index : index + 2]


def assert_clean(workers: list[ServiceProcess], timeout_s: float = 30.0) -> list[kpb.KVState]:
    """Every worker idle, check_integrity() holding, no hand-off in flight and no block held (free == total:
    cached prefixes count as free, they are evictable)."""

    def clean() -> list[kpb.KVState] | None:
        states = [kv_state(w) for w in workers]
        ok = all(
            s.integrity_ok and s.num_free_blocks == s.num_total_blocks and s.num_reserved_blocks == 0
            and s.num_incoming_transfers == 0 and s.num_outgoing_transfers == 0 and s.num_running == 0
            and s.num_waiting == 0
            for s in states
        )  # fmt: skip
        return states if ok else None

    def not_clean() -> str:
        return f"every worker to be idle with all blocks free; not clean: {[kv_state(w) for w in workers]}"

    return wait_until(clean, timeout_s, not_clean, interval_s=0.05)


def kv_transfer_bytes(fleet: LocalFleet, worker: ServiceProcess, direction: str) -> float:
    """flotilla_kv_transfer_bytes_total{direction} scraped from the worker's /metrics (0 before any transfer)."""
    return sum(sample.value for sample in metric_samples(fleet.metrics_targets()[worker.name])
               if sample.name == "flotilla_kv_transfer_bytes_total" and sample.labels.get("direction") == direction)
