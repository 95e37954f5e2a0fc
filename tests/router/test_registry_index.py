"""The registry's membership indexes follow registration, re-registration with other weights, deregistration,
eviction and state changes: placement inputs read from them match the workers registered now."""

from __future__ import annotations

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.registry import WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[WorkerRegistry, Clock]:
    clock = Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=1.0, evict_after_s=10.0, clock=clock,
                              channel_factory=lambda address: grpc.aio.insecure_channel(address))
    return registry, clock


def register(registry: WorkerRegistry, worker_id: str, model: str = "tiny", version: str = "v1",
             role: int = pb.WORKER_ROLE_BOTH, port: int = 1) -> None:
    registry.register(rpb.WorkerInfo(worker_id=worker_id, address=f"127.0.0.1:{port}", role=role,
                                     model=pb.ModelInfo(name=model, version=version, max_model_len=64)))
    registry.heartbeat(worker_id, pb.LoadReport(num_free_blocks=8, num_total_blocks=8, block_size=16))


def ids(entries) -> list[str]:
    return sorted(e.worker_id for e in entries)


def versions(registry: WorkerRegistry) -> list[tuple[str, str, float, bool]]:
    return sorted((r.name, r.version, r.first_registered, r.has_healthy_worker) for r in registry.model_versions())


async def test_reregistration_with_other_weights_moves_the_worker_between_versions():
    registry, clock = make()
    register(registry, "w1")
    clock.now = 101.0
    register(registry, "w2")
    register(registry, "p1", role=pb.WORKER_ROLE_PREFILL)
    assert ids(registry.healthy_workers("tiny", "v1")) == ["w1", "w2"]
    assert ids(registry.healthy_prefill_workers("tiny", "v1")) == ["p1"]
    assert versions(registry) == [("tiny", "v1", 100.0, True)]

    clock.now = 102.0
    register(registry, "w1", version="v2", port=2)  # restarted with new weights
    assert ids(registry.healthy_workers("tiny", "v1")) == ["w2"]
    assert ids(registry.healthy_workers("tiny", "v2")) == ["w1"]
    # v1's earliest worker is now w2 (101), v2's is w1's new registration
    assert versions(registry) == [("tiny", "v1", 101.0, True), ("tiny", "v2", 102.0, True)]
    assert registry.model_info("tiny", "v2").version == "v2"

    register(registry, "w1", version="v2", port=2)  # the same again: no duplicate
    assert ids(registry.healthy_workers("tiny", "v2")) == ["w1"]
    assert len(registry._token_workers()) == 3


async def test_deregistration_eviction_and_state_leave_no_stale_candidates():
    registry, clock = make()
    register(registry, "w1")
    register(registry, "w2", model="other")
    registry.set_state("w1", rpb.WORKER_STATE_DRAINING)
    assert registry.healthy_workers("tiny", "v1") == []
    assert not registry.has_active_replica("tiny") and registry.has_healthy_worker("tiny")
    registry.set_state("w1", rpb.WORKER_STATE_ACTIVE)
    assert ids(registry.healthy_workers("tiny", "v1")) == ["w1"]

    assert registry.deregister("w1")
    assert registry.healthy_workers("tiny", "v1") == [] and not registry.has_healthy_worker("tiny")
    assert versions(registry) == [("other", "v1", 100.0, True)]

    clock.now = 102.0  # w2's heartbeat is overdue: unhealthy, still registered
    assert versions(registry) == [("other", "v1", 100.0, False)]
    clock.now = 200.0  # and evicted
    await registry.sweep()
    assert registry.model_versions() == [] and registry.workers() == [] and registry._token_workers() == []
