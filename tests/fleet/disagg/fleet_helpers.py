"""Disaggregated fleets for tests: real router, gateway, prefill and decode worker processes on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from flotilla.api.common.v1 import common_pb2
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2_grpc
from flotilla.api.worker.v1 import worker_pb2, worker_pb2_grpc
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.fleet.local import FleetConfig, LocalFleet
from flotilla.fleet.process import ServiceProcess

MODEL = "flotilla-tiny"
NUM_KV_BLOCKS = 512
MAX_BATCHED_TOKENS = 128  # prompts over this are prefilled in chunks: one round of layer writes per chunk


def fleet_config(checkpoint: Path, state_dir: Path, num_prefill: int, num_decode: int, *extra: str) -> FleetConfig:
    return FleetConfig(
        model_dir=checkpoint,
        state_dir=state_dir,
        model_name=MODEL,
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
    with grpc.insecure_channel(worker.address) as channel:
        return kv_transfer_pb2_grpc.KVTransferServiceStub(channel).GetKVState(kpb.GetKVStateRequest(), timeout=10)


def load(worker: ServiceProcess) -> common_pb2.LoadReport:
    with grpc.insecure_channel(worker.address) as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)



def workers_with_role(fleet: LocalFleet, role: str) -> list[ServiceProcess]:
    return [w for w in fleet.workers if w.is_running() and ["--role", role] == _role_args(w)]


def _role_args(worker: ServiceProcess) -> list[str]:
    args = list(worker.args)
    index = len(args) - 1 - args[::-1].index("--role")
    return args[index : index + 2]


def until(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.005):
    """Poll `condition` until it returns something truthy; that value is returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


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

    try:
        return until(clean, timeout_s, "every worker to be idle with all blocks free", interval_s=0.05)
    except AssertionError:
        raise AssertionError(f"not clean: {[kv_state(w) for w in workers]}") from None


def kv_transfer_bytes(fleet: LocalFleet, worker: ServiceProcess, direction: str) -> float:
    """flotilla_kv_transfer_bytes_total{direction} scraped from the worker's /metrics (0 before any transfer)."""
    target = fleet.metrics_targets()[worker.name]
    text = httpx.get(f"http://{target}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "flotilla_kv_transfer_bytes_total" and sample.labels.get("direction") == direction)
