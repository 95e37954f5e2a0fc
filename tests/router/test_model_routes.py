"""The model registry in the router: first-version adoption, a new version gets traffic only through a rollout,
weighted split sticky per conversation, promote and rollback, the state file, and admission placing on it."""

from __future__ import annotations

import json

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission, Ticket
from flotilla.router.model_routes import ModelRoutes, RouteChangeError
from flotilla.router.models import ModelVersionRef, Route, affinity_bucket, resolve_model
from flotilla.router.placement import PlacementLimits
from flotilla.router.registry import WorkerRegistry

V1 = ModelVersionRef("tiny", "aaa111", 1.0, True)
V2 = ModelVersionRef("tiny", "bbb222", 2.0, True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(routes: ModelRoutes | None = None):
    clock = Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=1.0, clock=clock,
                              channel_factory=lambda address: grpc.aio.insecure_channel(address))
    routes = routes or ModelRoutes()
    admission = Admission(registry, routes, ("tiny",), PlacementLimits(1_000_000, 100_000), 8, 30.0)
    return registry, admission, routes, clock


def register(registry, clock, worker_id, version):
    clock.now += 1  # registration order is first_registered order
    model = pb.ModelInfo(name="tiny", version=version, max_model_len=2048, assets_digest="same-tokenizer")
    registry.register(rpb.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9", model=model))
    assert registry.heartbeat(worker_id, pb.LoadReport(num_free_blocks=64, num_total_blocks=64, block_size=16))


async def placed_version(admission, registry, conversation: str) -> str:
    placement = await admission.acquire("tiny", 4, ticket=Ticket(num_tokens=4, affinity_key=conversation))
    registry.release(placement.worker)
    return placement.resolution.version


def test_first_version_is_adopted_and_a_new_one_gets_no_traffic():
    routes = ModelRoutes()
    routes.observe([V1])
    assert routes.routes["tiny"] == Route(current=V1.version)
    routes.observe([V1, V2])  # v2 registers: the bare name stays on v1
    assert routes.routes["tiny"].current == V1.version
    assert resolve_model("tiny", [V1, V2], {}, routes=routes.routes, affinity_key="c").version == V1.version
    assert [c.action for c in routes.changes] == ["adopt"]


def test_unmanaged_route_follows_a_replaced_worker_but_a_managed_one_never_moves():
    routes = ModelRoutes()
    routes.observe([V1])
    routes.observe([V2])  # v1's only worker came back with new weights
    assert routes.routes["tiny"].current == V2.version and not routes.routes["tiny"].managed
    routes.set_rollout("tiny", V1.version, 10, [V1, V2])
    routes.promote("tiny")
    routes.observe([V2])  # the promoted v1 lost its workers: still v1 (requests wait, the operator decides)
    assert routes.routes["tiny"].current == V1.version and routes.routes["tiny"].managed


def test_split_is_within_3_points_of_the_weight_over_2000_conversations():
    routes = ModelRoutes()
    routes.observe([V1, V2])
    routes.routes["tiny"] = Route(current=V1.version)
    for percent in (5, 50, 95):
        routes.set_rollout("tiny", V2.version, percent, [V1, V2])
        picked = [resolve_model("tiny", [V1, V2], {}, routes=routes.routes, affinity_key=f"conv-{i}").version
                  for i in range(2000)]
        share = 100 * picked.count(V2.version) / len(picked)
        assert abs(share - percent) <= 3, (percent, share)


def test_growing_the_weight_only_moves_conversations_onto_the_candidate():
    routes = ModelRoutes()
    routes.observe([V1])
    routes.set_rollout("tiny", "bbb", 5, [V1, V2])  # a unique prefix names the version
    before = {k for k in range(2000) if routes.routes["tiny"].version_for("tiny", str(k)) == V2.version}
    routes.set_rollout("tiny", V2.version, 30, [V1, V2])
    after = {k for k in range(2000) if routes.routes["tiny"].version_for("tiny", str(k)) == V2.version}
    assert before < after
    # A hash, not process state: the same on any router, before and after a restart.
    assert affinity_bucket("tiny", V2.version, "conv-7") == affinity_bucket("tiny", V2.version, "conv-7")


async def test_200_conversations_of_5_turns_never_change_version_mid_rollout():
    registry, admission, routes, clock = make()
    register(registry, clock, "old", V1.version)
    assert await placed_version(admission, registry, "warm-up") == V1.version  # first version adopted
    register(registry, clock, "new", V2.version)
    routes.set_rollout("tiny", V2.version, 20, registry.model_versions())
    seen: dict[int, set[str]] = {}
    for _turn in range(5):
        for conversation in range(200):
            seen.setdefault(conversation, set()).add(await placed_version(admission, registry, f"user-{conversation}"))
    assert all(len(versions) == 1 for versions in seen.values())
    on_candidate = sum(1 for versions in seen.values() if versions == {V2.version})
    assert 20 <= on_candidate <= 60  # ~40 of 200 at 20 %


async def test_rollback_sends_new_requests_to_the_current_version_and_promote_moves_all():
    registry, admission, routes, clock = make()
    register(registry, clock, "old", V1.version)
    await placed_version(admission, registry, "x")
    register(registry, clock, "new", V2.version)
    routes.set_rollout("tiny", V2.version, 100, registry.model_versions())
    assert await placed_version(admission, registry, "a") == V2.version
    routes.rollback("tiny", registry.model_versions())
    assert {await placed_version(admission, registry, f"k{i}") for i in range(50)} == {V1.version}
    routes.set_rollout("tiny", V2.version, 5, registry.model_versions())
    routes.promote("tiny")
    assert routes.routes["tiny"] == Route(current=V2.version, previous=V1.version, managed=True)
    assert {await placed_version(admission, registry, f"k{i}") for i in range(50)} == {V2.version}
    routes.rollback("tiny", registry.model_versions())  # after a promotion: back to the previous version
    assert {await placed_version(admission, registry, f"k{i}") for i in range(50)} == {V1.version}


async def test_a_split_version_without_a_healthy_worker_gives_way_to_the_other():
    registry, admission, routes, clock = make()
    register(registry, clock, "old", V1.version)
    await placed_version(admission, registry, "x")
    register(registry, clock, "new", V2.version)
    routes.set_rollout("tiny", V2.version, 100, registry.model_versions())
    registry.mark_failed("new")
    assert await placed_version(admission, registry, "a") == V1.version


def test_refused_changes_say_why():
    routes = ModelRoutes({"chat": "tiny", "pinned": f"tiny@{V1.version}"})
    with pytest.raises(RouteChangeError) as err:
        routes.set_rollout("tiny", V2.version, 5, [V1, V2])
    assert err.value.kind == "not_found"  # no current version yet
    routes.observe([V1, V2])
    routes.routes["tiny"] = Route(current=V1.version)
    for call, kind in [(lambda: routes.set_rollout("tiny", V2.version, 101, [V1, V2]), "invalid"),
                       (lambda: routes.set_rollout("tiny", "zzz", 5, [V1, V2]), "not_found"),
                       (lambda: routes.set_rollout("tiny", V1.version, 5, [V1, V2]), "invalid"),
                       (lambda: routes.set_rollout("pinned", V2.version, 5, [V1, V2]), "invalid"),
                       (lambda: routes.promote("tiny"), "precondition"),
                       (lambda: routes.rollback("tiny", [V1, V2]), "precondition"),
                       (lambda: routes.set_alias("chat2", "chat"), "invalid")]:
        with pytest.raises(RouteChangeError) as err:
            call()
        assert err.value.kind == kind
    name, _ = routes.set_rollout("chat", V2.version, 5, [V1, V2])  # an alias of a name rolls out that name
    assert name == "tiny" and routes.routes["tiny"].candidate == V2.version


def test_state_file_keeps_routes_and_aliases_across_restarts(tmp_path):
    path = tmp_path / "routes.json"
    seen = []
    routes = ModelRoutes({"chat": "tiny"}, path, listener=lambda change, name, route: seen.append(change.action))
    routes.observe([V1, V2])
    routes.routes["tiny"] = Route(current=V1.version)
    routes.set_rollout("chat", V2.version, 5, [V1, V2])
    routes.set_alias("stable", f"tiny@{V1.version}")
    assert seen == ["adopt", "rollout", "alias"]
    restarted = ModelRoutes({"chat": "other"}, path)
    assert restarted.routes == routes.routes
    assert restarted.aliases == {"chat": "tiny", "stable": f"tiny@{V1.version}"}  # the file wins over flags
    assert json.loads(path.read_text())["routes"]["tiny"]["candidate_percent"] == 5
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="model routes file"):
        ModelRoutes({}, bad)
