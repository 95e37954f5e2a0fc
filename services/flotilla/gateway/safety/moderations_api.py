"""POST /v1/moderations (the OpenAI shape), answered by the caller's safety policy, so that clients can check
text themselves: `{"input": str | [str]}` -> `{"id", "model": <policy>, "results": [{"flagged", "categories",
"category_scores"}]}`. Without a policy nothing is flagged."""

from __future__ import annotations

import asyncio
import uuid

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway.auth import authenticate
from flotilla.gateway.body import parse_body, read_body
from flotilla.gateway.context import dialect_endpoint, gateway_context
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.safety.classifier import ClassifierUnavailable
from flotilla.gateway.safety.stage import policy_for
from flotilla.gateway.safety.verdict import Moderation
from flotilla.gateway.schema_base import RequestModel

MAX_INPUTS = 256


class ModerationRequest(RequestModel):
    input: str | list[str] = Field(min_length=1)
    model: str | None = None  # accepted; the caller's policy decides

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


@dialect_endpoint(Dialect.OPENAI)
async def create_moderation(request: Request) -> Response:
    ctx = gateway_context(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(ModerationRequest, await read_body(request, ctx.settings.max_body_bytes))
    if len(params.texts) > MAX_INPUTS:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"at most {MAX_INPUTS} inputs per request", param="input")
    policy = policy_for(ctx.safety, principal)
    if policy is None:
        results = [Moderation(False, {}) for _ in params.texts]
    else:  # at once: a classifier gets them in one batch
        try:
            results = await asyncio.gather(*(policy.moderate(text) for text in params.texts))
        except ClassifierUnavailable as err:  # no fail mode here: the caller asked for the classifier's answer
            raise GatewayError(ErrorKind.UNAVAILABLE, "the safety classifier is unavailable; retry later",
                               code="safety_unavailable") from err
    return JSONResponse({"id": f"modr-{uuid.uuid4().hex}", "model": policy.name if policy else "none",
                         "results": [_result(result) for result in results]})


def _result(moderation: Moderation) -> dict:
    return {"flagged": moderation.flagged, "categories": moderation.categories,
            "category_scores": {name: float(hit) for name, hit in moderation.categories.items()}}
