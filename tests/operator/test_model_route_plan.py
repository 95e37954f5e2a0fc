"""FlotillaModelRoute's planner: the router RPCs that bring a model's route to the spec, in order."""

from __future__ import annotations

import pytest

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.operator.model_route import InvalidRouteSpec, parse_route_spec, plan


def rpcs(spec: dict, route: rpb.ModelRoute | None, aliases: dict | None = None) -> tuple[list[str], str]:
    actions, blocked = plan(parse_route_spec(spec), route, aliases or {})
    return [a.describe() for a in actions], blocked


ROUTE = rpb.ModelRoute(name="tiny", current_version="aaa111")


def test_rollout_weight_and_removal():
    assert rpcs({"model": "tiny", "rollout": {"version": "bbb", "weightPercent": 5}}, ROUTE) == (
        ["SetModelRollout(model=tiny version=bbb weight_percent=5.0)"], "")
    rolling = rpb.ModelRoute(name="tiny", current_version="aaa111", candidate_version="bbb222",
                             candidate_weight_percent=5)
    assert rpcs({"model": "tiny", "rollout": {"version": "bbb", "weightPercent": 5}}, rolling) == ([], "")
    assert rpcs({"model": "tiny", "rollout": {"version": "bbb", "weightPercent": 50}}, rolling)[0] == [
        "SetModelRollout(model=tiny version=bbb weight_percent=50.0)"]
    assert rpcs({"model": "tiny"}, rolling) == (["RollbackModel(model=tiny)"], "")


def test_current_version_promotes_the_candidate_or_returns_to_the_previous():
    rolling = rpb.ModelRoute(name="tiny", current_version="aaa111", candidate_version="bbb222",
                             candidate_weight_percent=50)
    promote = {"model": "tiny", "currentVersion": "bbb", "rollout": {"version": "bbb", "weightPercent": 50}}
    assert rpcs(promote, rolling) == (["PromoteModel(model=tiny)"], "")
    promoted = rpb.ModelRoute(name="tiny", current_version="bbb222", previous_version="aaa111")
    assert rpcs(promote, promoted) == ([], "")  # done: nothing more
    assert rpcs({"model": "tiny", "currentVersion": "aaa111"}, promoted) == (["RollbackModel(model=tiny)"], "")
    actions, blocked = rpcs({"model": "tiny", "currentVersion": "ccc"}, promoted)
    assert actions == [] and "roll it out first" in blocked


def test_aliases_and_an_unknown_model():
    assert rpcs({"model": "tiny", "aliases": ["chat", "default"]}, ROUTE, {"default": "tiny"}) == (
        ["SetModelAlias(alias=chat target=tiny)"], "")
    actions, blocked = rpcs({"model": "tiny", "aliases": ["chat"], "rollout": {"version": "b", "weightPercent": 1}},
                            None)
    assert actions == ["SetModelAlias(alias=chat target=tiny)"] and "no registered version" in blocked


def test_bad_specs_are_refused():
    for spec in ({}, {"model": ""}, {"model": "tiny", "rollout": {"weightPercent": 5}},
                 {"model": "tiny", "rollout": {"version": "b", "weightPercent": 150}}):
        with pytest.raises(InvalidRouteSpec):
            parse_route_spec(spec)
