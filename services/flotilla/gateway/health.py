"""Probes and metrics: /healthz (process alive), /readyz (router reachable, >= 1 model), /metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway.context import gateway_context
from flotilla.gateway.errors import GatewayError


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    try:
        models = await gateway_context(request).registry.refresh()
    except GatewayError as err:
        return JSONResponse({"status": "unavailable", "reason": err.message}, status_code=503)
    if not models:
        return JSONResponse({"status": "unavailable", "reason": "the router serves no model"}, status_code=503)
    return JSONResponse({"status": "ready", "models": [m.name for m in models]})


async def metrics(request: Request) -> Response:
    registry = gateway_context(request).metrics
    return Response(registry.exposition(), media_type=registry.content_type)
