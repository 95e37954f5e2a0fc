"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches/{id}, GET /v1/batches (newest first, `after` and
`limit`), POST /v1/batches/{id}/cancel. A job is `validating` until its input file is checked
(openai_jsonl.py), then `in_progress`, `finalizing` and `completed` (or `failed`, `expired`, `cancelling` ->
`cancelled`); its answers are in output_file_id (2xx) and error_file_id (the rest), read with the Files API."""

from __future__ import annotations

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway.auth import authenticate
from flotilla.gateway.batch_jobs.records import (CANCELED, ERRORED, EXPIRED_ITEM, OPENAI, SUCCEEDED, BatchJob,
                                                 new_id)
from flotilla.gateway.batch_jobs.service import BatchJobs, batch_jobs
from flotilla.gateway.body import parse_body, read_body
from flotilla.gateway.context import dialect_endpoint, gateway_context
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.schema_base import RequestModel

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_PAGE = 100
_TIMES = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


class CreateBatchRequest(RequestModel):
    input_file_id: str
    # Checked by create_batch (its own messages); the enums only describe them in /openapi.json.
    endpoint: str = pydantic.Field(json_schema_extra={"enum": list(ENDPOINTS)})
    completion_window: str = pydantic.Field(json_schema_extra={"enum": ["24h"]})
    metadata: dict[str, str] | None = pydantic.Field(default=None, max_length=16)


async def batch_object(jobs: BatchJobs, job: BatchJob) -> dict:
    counts = await jobs.store.result_counts(job.id)
    body = {"id": job.id, "object": "batch", "endpoint": job.endpoint, "model": None,
            "errors": {"object": "list", "data": job.errors} if job.errors else None,
            "input_file_id": job.input_file_id, "completion_window": job.completion_window, "status": job.status,
            "output_file_id": job.output_file_id, "error_file_id": job.error_file_id,
            "created_at": int(job.created_at), "expires_at": int(job.expires_at),
            "request_counts": {"total": job.num_items, "completed": counts.get(SUCCEEDED, 0),
                               "failed": sum(counts.get(t, 0) for t in (ERRORED, CANCELED, EXPIRED_ITEM))},
            "metadata": job.metadata}
    for status in _TIMES:
        body[f"{status}_at"] = int(job.times[status]) if status in job.times else None
    return body


@dialect_endpoint(Dialect.OPENAI)
async def create_batch(request: Request) -> Response:
    ctx, jobs = gateway_context(request), batch_jobs(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(CreateBatchRequest, await read_body(request, ctx.settings.max_body_bytes))
    if params.endpoint not in ENDPOINTS:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"endpoint must be one of {', '.join(ENDPOINTS)}",
                           param="endpoint")
    if params.completion_window != "24h":
        raise GatewayError(ErrorKind.INVALID_REQUEST, "completion_window must be '24h'", param="completion_window")
    try:
        meta = await jobs.owned_file(params.input_file_id, principal)
    except GatewayError as err:
        raise GatewayError(ErrorKind.INVALID_REQUEST, err.message, param="input_file_id") from err
    if meta.purpose != "batch":
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"file {meta.id} has purpose {meta.purpose!r}, not 'batch'",
                           param="input_file_id")
    job = jobs.new_job(new_id("batch_"), OPENAI, principal, params.endpoint, input_file_id=meta.id,
                       metadata=params.metadata)
    await jobs.start_job(job)
    return JSONResponse(await batch_object(jobs, job))


@dialect_endpoint(Dialect.OPENAI)
async def get_batch(request: Request) -> Response:
    jobs = batch_jobs(request)
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    job = await jobs.owned_job(request.path_params["batch_id"], principal, OPENAI, "batch")
    return JSONResponse(await batch_object(jobs, job))


@dialect_endpoint(Dialect.OPENAI)
async def list_batches(request: Request) -> Response:
    jobs = batch_jobs(request)
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    limit = page_limit(request.query_params.get("limit"), default=20)
    all_jobs = await jobs.store.list_jobs(principal.tenant, OPENAI)
    page = page_after(all_jobs, request.query_params.get("after"), limit + 1)
    data = [await batch_object(jobs, job) for job in page[:limit]]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit})


@dialect_endpoint(Dialect.OPENAI)
async def cancel_batch(request: Request) -> Response:
    jobs = batch_jobs(request)
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    job = await jobs.owned_job(request.path_params["batch_id"], principal, OPENAI, "batch")
    if not job.is_active and job.status != "cancelled":
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"batch {job.id} is {job.status}: it cannot be cancelled")
    return JSONResponse(await batch_object(jobs, await jobs.cancel(job)))


def page_limit(text: str | None, default: int, maximum: int = MAX_PAGE) -> int:
    if text is None:
        return default
    # Checked as text first: "١٢" is a digit to isdigit(), and int() of thousands of digits is slow.
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(maximum)) and 1 <= int(text) <= maximum):
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"limit must be an integer from 1 to {maximum}",
                           param="limit")
    return int(text)


def page_after(jobs: list[BatchJob], after: str | None, count: int) -> list[BatchJob]:
    """Up to `count` jobs after the one with id `after` (newest first); an unknown cursor is a 400."""
    start = 0
    if after:
        ids = [job.id for job in jobs]
        if after not in ids:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"after: no batch with id {after!r}", param="after")
        start = ids.index(after) + 1
    return jobs[start:start + count]
