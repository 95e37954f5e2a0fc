"""GET /v1/models and GET /v1/models/{id}: one body that reads as both OpenAI's and Anthropic's list."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway.auth import authenticate
from flotilla.gateway.context import dialect_endpoint, gateway_context
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.model_registry import ServedModel

# Models carry no creation time over the wire; a fixed epoch keeps the answers stable.
CREATED_UNIX = 0
CREATED_RFC3339 = "1970-01-01T00:00:00Z"


@dialect_endpoint(Dialect.OPENAI)
async def list_models(request: Request) -> Response:
    ctx = gateway_context(request)
    await authenticate(request.headers, ctx.gatekeeper)
    try:
        models = await ctx.registry.refresh()
    except GatewayError:
        models = ctx.registry.models  # the last list we had beats an error for a listing
    data = [model_entry(m) for m in _distinct_names(models)]
    return JSONResponse({"object": "list", "data": data, "has_more": False,
                         "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


@dialect_endpoint(Dialect.OPENAI)
async def get_model(request: Request) -> Response:
    ctx = gateway_context(request)
    await authenticate(request.headers, ctx.gatekeeper)
    return JSONResponse(model_entry(await ctx.registry.resolve(request.path_params["model_id"])))


def model_entry(model: ServedModel) -> dict:
    return {"id": model.name, "object": "model", "created": CREATED_UNIX, "owned_by": "flotilla",
            "type": "model", "display_name": model.name, "created_at": CREATED_RFC3339,
            "max_model_len": model.max_model_len, "version": model.version, "aliases": list(model.aliases)}


def _distinct_names(models: list[ServedModel]) -> list[ServedModel]:
    seen: dict[str, ServedModel] = {}
    for model in models:
        seen.setdefault(model.name, model)
    return list(seen.values())
