"""Probes: /healthz (process alive), /readyz (router reachable, >= 1 model). /metrics is on its own listener
(server.py), never on the public port.

Both probes say "degraded" while Redis (keys, quotas) is unreachable; /readyz then answers 503 when the
gateway fails closed (it refuses keyed requests), 200 when it fails open.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway.context import gateway_context
from flotilla.gateway.errors import GatewayError


async def healthz(request: Request) -> Response:
    degraded = await _redis_state(request)
    return JSONResponse({"status": "degraded", **degraded} if degraded else {"status": "ok"})


async def _redis_state(request: Request) -> dict | None:
    """None when healthy; else what is wrong. Pinging Redis here also clears the state on recovery."""
    gatekeeper = gateway_context(request).gatekeeper
    if gatekeeper is None or await gatekeeper.check():
        return None
    return {"redis": "unreachable", "fail_mode": gatekeeper.fail_mode.value}


async def readyz(request: Request) -> Response:
    try:
        models = await gateway_context(request).registry.refresh()
    except GatewayError as err:
        return JSONResponse({"status": "unavailable", "reason": err.message}, status_code=503)
    if not models:
        return JSONResponse({"status": "unavailable", "reason": "the router serves no model"}, status_code=503)
    degraded = await _redis_state(request)
    if degraded:
        status_code = 503 if degraded["fail_mode"] == "closed" else 200
        return JSONResponse({"status": "degraded", **degraded, "models": [m.name for m in models]},
                            status_code=status_code)
    return JSONResponse({"status": "ready", "models": [m.name for m in models]})

