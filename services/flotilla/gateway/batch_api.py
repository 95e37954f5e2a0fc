"""POST /v1/batch-generate: one input string in, its output string out, for models served by fixed-batch
workers (`flotilla worker --backend fixed-batch`). The router batches concurrent calls onto the workers'
run_batch (router/batch_dispatcher.py); this handler waits for its own call's answer.

Its own route rather than /v1/completions: the contract has no tokens, sampling, stop strings, logprobs or
streaming, so a completions body would be mostly refused fields, and the gateway needs no tokenizer for it.
Auth, tiers (paid calls are batched first), deadlines (x-flotilla-deadline-ms, or the tier's default) and
Idempotency-Key work as on the other routes; quotas count one token per call (requests and concurrency limits
as usual). Errors are in the OpenAI shape.
"""

from __future__ import annotations

import time

import grpc
import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.gateway.admission import admit
from flotilla.gateway.auth import authenticate
from flotilla.gateway.body import parse_body, read_body
from flotilla.gateway.context import dialect_endpoint, gateway_context, request_id
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import ErrorKind, GatewayError, error_from_grpc, error_from_router
from flotilla.gateway.generation import until_disconnected
from flotilla.gateway.schema_base import RequestModel
from flotilla.rpc.stream_events import Error

MAX_INPUT_CHARS = 1 << 20


class BatchGenerateRequest(RequestModel):
    model: str | None = None
    input: str = pydantic.Field(max_length=MAX_INPUT_CHARS)


@dialect_endpoint(Dialect.OPENAI)
async def batch_generate(request: Request) -> Response:
    ctx = gateway_context(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    body = parse_body(BatchGenerateRequest, await read_body(request, ctx.settings.max_body_bytes))
    model = body.model or ctx.settings.default_model
    if not model:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model: Field required", param="model")
    rid = request_id(request)
    admitted = await admit(request, ctx.gatekeeper, ctx.settings.admission, Dialect.OPENAI, principal, rid, 1, 0)
    call = rpb.BatchCall(request_id=rid, model=model, input=body.input, tier=principal.tier,
                         tenant_id=principal.tenant, deadline_unix_s=admitted.ticket.deadline_unix_s)
    used = 0
    try:
        try:
            result = await until_disconnected(request, ctx.backend.batch_generate(call))
        except grpc.RpcError as err:
            raise error_from_grpc(err, rid) from err
        if result.HasField("error"):
            e = result.error
            raise error_from_router(Error(e.code, e.message, e.field, e.retry_after_s), rid)
        used = 1
    finally:
        if admitted.gatekeeper is not None and admitted.reservation is not None:
            admitted.gatekeeper.settle_soon(admitted.reservation, used)
    return JSONResponse({
        "id": "bgen-" + rid.removeprefix("req_"), "object": "batch_generation", "created": int(time.time()),
        "model": model, "output": result.output,
        "batch": {"id": result.batch_id, "index": result.batch_index, "size": result.batch_size,
                  "attempts": result.num_attempts, "worker_id": result.worker_id,
                  "queued_ms": round(result.queued_s * 1000, 3)},
    })
