"""FlotillaModelRoute: a model name's route (aliases, rollout, current version) declared as a Kubernetes resource
and applied to the router by the operator through the router's model-lifecycle RPCs (router/model_routes.py).

    spec:
      model: tiny                        # the model name (the pools' spec.model.name)
      aliases: [chat]                    # aliases pointing at the name (never removed by the operator)
      rollout: {version: 3f9a, weightPercent: 5}   # a candidate and its share; absent: no rollout (rolled back)
      currentVersion: 3f9a               # optional: promote the candidate, or roll back to the previous version

`plan` (pure) compares the spec with the router's route and returns the RPCs that close the gap; the handler
runs them on create/update and again on a timer (a restarted router without a state file gets its routes
back). A spec the router cannot reach (a currentVersion that is neither the candidate nor the previous version,
a version no worker serves) is reported in the status, not retried blindly. Versions may be unique prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc

PLURAL = "flotillamodelroutes"
KIND = "FlotillaModelRoute"


class InvalidRouteSpec(ValueError):
    pass


@dataclass(frozen=True)
class RouteSpec:
    model: str
    aliases: tuple[str, ...] = ()
    rollout_version: str = ""
    rollout_percent: float = 0.0
    current_version: str = ""
    router_address: str = ""


def parse_route_spec(spec: dict[str, Any]) -> RouteSpec:
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRouteSpec("spec.model (a model name) is required")
    rollout = spec.get("rollout") or {}
    percent = float(rollout.get("weightPercent", 0.0))
    if rollout and (not rollout.get("version") or not 0.0 <= percent <= 100.0):
        raise InvalidRouteSpec("spec.rollout needs a version and a weightPercent within 0..100")
    return RouteSpec(model, tuple(spec.get("aliases") or ()), str(rollout.get("version", "")), percent,
                     str(spec.get("currentVersion", "")), str(spec.get("routerAddress", "")))


@dataclass(frozen=True)
class Action:
    rpc: str  # SetModelAlias, PromoteModel, RollbackModel, SetModelRollout
    request: Any

    def describe(self) -> str:
        return f"{self.rpc}({' '.join(f'{f.name}={v}' for f, v in self.request.ListFields())})"


def _is(version: str, wanted: str) -> bool:
    return bool(wanted) and version.startswith(wanted)


def plan(spec: RouteSpec, route: rpb.ModelRoute | None, aliases: dict[str, str]) -> tuple[list[Action], str]:
    """(the RPCs to run in order, why the spec cannot be reached or ""). `route` None: the router does not know
    the model yet (no version registered): only aliases can be set."""
    actions = [Action("SetModelAlias", rpb.SetModelAliasRequest(alias=a, target=spec.model))
               for a in spec.aliases if aliases.get(a) != spec.model]
    if route is None or not route.current_version:
        return actions, f"model {spec.model!r} has no registered version yet" if (
            spec.rollout_version or spec.current_version) else ""
    current, candidate, previous = route.current_version, route.candidate_version, route.previous_version
    if spec.current_version and not _is(current, spec.current_version):
        if _is(candidate, spec.current_version):
            actions.append(Action("PromoteModel", rpb.PromoteModelRequest(model=spec.model)))
            current, candidate = candidate, ""
        elif not candidate and _is(previous, spec.current_version):
            actions.append(Action("RollbackModel", rpb.RollbackModelRequest(model=spec.model)))
            current = previous
        else:
            return actions, (f"currentVersion {spec.current_version} is neither the rollout's candidate nor the "
                             f"previous version: roll it out first")
    wants_rollout = bool(spec.rollout_version) and not _is(current, spec.rollout_version)
    if wants_rollout and not (_is(candidate, spec.rollout_version)
                              and route.candidate_weight_percent == spec.rollout_percent):
        actions.append(Action("SetModelRollout", rpb.SetModelRolloutRequest(
            model=spec.model, version=spec.rollout_version, weight_percent=spec.rollout_percent)))
    elif not wants_rollout and candidate:
        actions.append(Action("RollbackModel", rpb.RollbackModelRequest(model=spec.model)))
    return actions, ""


def apply(stub: router_pb2_grpc.RouterServiceStub, spec: RouteSpec, timeout_s: float = 5.0) -> dict[str, Any]:
    """Run the plan against the router; -> the resource's status. Raises grpc.RpcError when unreachable."""
    listed = stub.ListModelRoutes(rpb.ListModelRoutesRequest(), timeout=timeout_s)
    route = next((r for r in listed.routes if r.name == spec.model), None)
    actions, blocked = plan(spec, route, {a.alias: a.target for a in listed.aliases})
    applied = []
    for action in actions:
        try:
            answer = getattr(stub, action.rpc)(action.request, timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            blocked = f"{action.describe()} refused: {err.details()}"
            break
        applied.append(answer.change.detail)
        if answer.HasField("route"):
            route = answer.route
    status = {
        "currentVersion": route.current_version if route else None,
        "candidateVersion": (route.candidate_version or None) if route else None,
        "candidateWeightPercent": route.candidate_weight_percent if route and route.candidate_version else None,
        "blocked": blocked or None,
    }
    if applied:  # kept until the next change (a quiet timer run leaves it)
        status["lastApplied"] = applied[-5:]
    return status
