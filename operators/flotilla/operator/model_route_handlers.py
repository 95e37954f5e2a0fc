"""kopf handlers for FlotillaModelRoute (model_route.py): apply the route on create/update/resume and again on
a timer, writing what the router holds now into the status. With several routers (a comma list of addresses) the
route is applied to each: every router routes the model the same way, and one that restarted (forgetting its
routes) gets it back at the next timer run. The status is the first router's; `blocked` is any router's."""

from __future__ import annotations

from typing import Any

import grpc
import kopf

from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.operator.config import OperatorConfig
from flotilla.operator.model_route import PLURAL, InvalidRouteSpec, apply, parse_route_spec
from flotilla.operator.pool_spec import GROUP, VERSION
from flotilla.rpc.options import sync_channel
from flotilla.rpc.router_ownership import split_addresses
from flotilla.rpc.tls import InternalTLS


def register_model_route_handlers(registry: kopf.OperatorRegistry, config: OperatorConfig,
                                  router_tls: InternalTLS | None) -> None:
    """router_tls: the operator's certificate (only operators may change routes: router/access.py)."""
    stubs: dict[str, router_pb2_grpc.RouterServiceStub] = {}

    def stub_for(address: str) -> router_pb2_grpc.RouterServiceStub:
        if address not in stubs:
            stubs[address] = router_pb2_grpc.RouterServiceStub(sync_channel(address, router_tls, "router"))
        return stubs[address]

    def reconcile(spec: kopf.Spec, patch: kopf.Patch, logger) -> None:
        try:
            route = parse_route_spec(dict(spec))
        except InvalidRouteSpec as error:
            raise kopf.PermanentError(str(error)) from None
        address = route.router_address or config.router_address
        if not address:
            patch.status["blocked"] = "no router address (spec.routerAddress or FLOTILLA_ROUTER_ADDRESS)"
            return
        try:
            statuses = [apply(stub_for(one), route) for one in split_addresses(address)]
        except grpc.RpcError as error:
            raise kopf.TemporaryError(f"router unreachable: {error.code()}", delay=config.interval_s)
        status = statuses[0]
        status["blocked"] = next((s["blocked"] for s in statuses if s["blocked"]), None)
        for key, value in status.items():
            patch.status[key] = value
        for detail in status.get("lastApplied") or ():
            logger.info("model route %s: %s", route.model, detail)
        if status["blocked"]:
            logger.warning("model route %s: %s", route.model, status["blocked"])

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    def apply_route(spec: kopf.Spec, patch: kopf.Patch, logger, **_: Any) -> None:
        reconcile(spec, patch, logger)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=config.interval_s, registry=registry)
    def reapply_route(spec: kopf.Spec, patch: kopf.Patch, logger, **_: Any) -> None:
        reconcile(spec, patch, logger)
