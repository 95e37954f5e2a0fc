"""Placement policy and model-name resolution: pure functions, no gRPC."""

from __future__ import annotations

import pytest

from flotilla.router.models import (
    ModelNotFoundError,
    ModelVersionRef,
    Resolution,
    aliases_of,
    expected_names,
    resolve_model,
)
from flotilla.router.placement import PlacementLimits, WorkerLoad, can_admit, choose_worker

LIMITS = PlacementLimits(max_queued_tokens_per_worker=1000, max_requests_per_worker=4)


def load(worker_id: str, queued: int = 0, requests: int = 0, free: int = 100) -> WorkerLoad:
    return WorkerLoad(worker_id, queued, requests, free, 100)


def test_fewest_queued_tokens_wins():
    loads = [load("a", queued=300), load("b", queued=100), load("c", queued=200)]
    assert choose_worker(loads, 10, LIMITS) == "b"


def test_free_blocks_break_ties_on_queued_tokens():
    loads = [load("a", queued=100, free=10), load("b", queued=100, free=50)]
    assert choose_worker(loads, 10, LIMITS) == "b"


def test_ties_are_deterministic():
    assert choose_worker([load("b"), load("a")], 10, LIMITS) == "a"


def test_worker_over_token_cap_gets_nothing():
    assert not can_admit(load("a", queued=950), 100, LIMITS)
    assert choose_worker([load("a", queued=950), load("b", queued=960)], 100, LIMITS) is None
    assert choose_worker([load("a", queued=950), load("b", queued=800)], 100, LIMITS) == "b"


def test_idle_worker_takes_a_prompt_longer_than_the_cap():
    assert can_admit(load("a", queued=0), 5000, LIMITS)
    assert not can_admit(load("a", queued=1), 5000, LIMITS)


def test_request_cap():
    assert not can_admit(load("a", requests=4), 1, LIMITS)
    assert can_admit(load("a", requests=3), 1, LIMITS)


def test_no_workers_no_placement():
    assert choose_worker([], 1, LIMITS) is None


def test_limits_are_validated():
    with pytest.raises(ValueError):
        PlacementLimits(max_queued_tokens_per_worker=0)


VERSIONS = [
    ModelVersionRef("tiny", "v1", first_registered=1.0, has_healthy_worker=True),
    ModelVersionRef("tiny", "v2", first_registered=2.0, has_healthy_worker=True),
    ModelVersionRef("small", "s1", first_registered=1.5, has_healthy_worker=True),
]
ALIASES = {"default": "tiny", "pinned": "tiny@v1", "future": "big"}


def test_bare_name_resolves_to_newest_version():
    assert resolve_model("tiny", VERSIONS, ALIASES) == Resolution("tiny", "v2")


def test_bare_name_prefers_a_version_with_a_healthy_worker():
    versions = [VERSIONS[0], ModelVersionRef("tiny", "v2", 2.0, has_healthy_worker=False)]
    assert resolve_model("tiny", versions, ALIASES) == Resolution("tiny", "v1")


def test_exact_version():
    assert resolve_model("tiny@v1", VERSIONS, ALIASES) == Resolution("tiny", "v1")
    with pytest.raises(ModelNotFoundError):
        resolve_model("tiny@v9", VERSIONS, ALIASES)


def test_aliases():
    assert resolve_model("default", VERSIONS, ALIASES) == Resolution("tiny", "v2")
    assert resolve_model("pinned", VERSIONS, ALIASES) == Resolution("tiny", "v1")
    assert resolve_model("pinned", VERSIONS, ALIASES).qualified == "tiny@v1"


def test_unknown_name_is_not_found_unless_expected():
    with pytest.raises(ModelNotFoundError):
        resolve_model("nope", VERSIONS, ALIASES)
    names = expected_names(["medium"], ALIASES)
    assert names == {"medium", "tiny", "big"}
    assert resolve_model("medium", VERSIONS, ALIASES, names) == Resolution("medium", None)
    assert resolve_model("future", VERSIONS, ALIASES, names) == Resolution("big", None)


def test_aliases_of_a_version():
    assert aliases_of(VERSIONS[1], VERSIONS, ALIASES) == ["default"]
    assert aliases_of(VERSIONS[0], VERSIONS, ALIASES) == ["pinned"]
    assert aliases_of(VERSIONS[2], VERSIONS, ALIASES) == []


def test_an_idle_tenant_may_go_over_the_request_cap_by_the_extra_slots_only():
    limits = PlacementLimits(max_queued_tokens_per_worker=1000, max_requests_per_worker=4, idle_tenant_extra_slots=1)
    full = load("a", queued=100, requests=4)
    assert not can_admit(full, 10, limits)
    assert can_admit(full, 10, limits, idle_tenant=True)
    assert not can_admit(load("a", queued=100, requests=5), 10, limits, idle_tenant=True)
    assert choose_worker([full], 10, limits, idle_tenant=True) == "a"
    assert not can_admit(full, 10, LIMITS, idle_tenant=True)  # off by default
    with pytest.raises(ValueError):
        PlacementLimits(idle_tenant_extra_slots=-1)


def test_batch_requests_keep_off_workers_below_the_free_kv_watermark():
    limits = PlacementLimits(1000, 4, batch_min_free_kv_fraction=0.25)
    loads = [load("a", free=20), load("b", queued=500, free=30)]
    assert choose_worker(loads, 10, limits) == "a"  # interactive: the most headroom, watermark or not
    assert choose_worker(loads, 10, limits, batch=True) == "b"
    assert choose_worker([load("a", free=24)], 10, limits, batch=True) is None
    with pytest.raises(ValueError):
        PlacementLimits(batch_min_free_kv_fraction=1.0)
