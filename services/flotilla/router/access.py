"""Who may call which RouterService method, by the role in the caller's certificate (rpc/tls.py enforces it):
workers manage their own membership, gateways place and stream requests, the operator (autoscaler) watches
and steers the pool. Worker ids are bound to the identity that registered them (service.py)."""

from __future__ import annotations

_METHOD = "/flotilla.router.v1.RouterService/{}"
_FRONT = ("gateway", "operator")

ROUTER_POLICY: dict[str, tuple[str, ...]] = {
    _METHOD.format(name): roles
    for name, roles in {
        "RegisterWorker": ("worker",),
        "Heartbeat": ("worker",),
        "DeregisterWorker": ("worker",),
        "PublishModelAssets": ("worker",),
        "Generate": _FRONT,
        "GenerateSession": _FRONT,
        "Acquire": _FRONT,
        "AcquireSession": _FRONT,
        "BatchGenerateSession": _FRONT,
        "GetModelAssets": _FRONT,
        # The router's own exec probe (`flotilla probe router`, with the router's certificate) calls it too.
        "ListModels": (*_FRONT, "router"),
        "ListWorkers": ("operator",),
        "SetWorkerState": ("operator",),
        "GetPoolSignals": ("operator",),
        "GetQueueLoad": _FRONT,  # gateways degrade free-tier requests on it (gateway/degradation.py)
        # The model registry (router/lifecycle_service.py): `flotilla models` and the operator's FlotillaModelRoute.
        "ListModelRoutes": ("operator",),
        "SetModelAlias": ("operator",),
        "SetModelRollout": ("operator",),
        "PromoteModel": ("operator",),
        "RollbackModel": ("operator",),
        "GetModelStatus": ("operator",),
    }.items()
}
