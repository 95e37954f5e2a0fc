"""Anthropic's Message Batches API: POST /v1/messages/batches (`requests: [{custom_id, params}]`), GET
/v1/messages/batches/{id}, GET /v1/messages/batches (newest first; `limit`, `after_id`, `before_id`), POST
/v1/messages/batches/{id}/cancel, GET /v1/messages/batches/{id}/results (JSONL, one line per request:
result.type succeeded | errored | canceled | expired). Each request's params are a POST /v1/messages body,
checked when it runs: a bad one is an `errored` result, as the synchronous call would have answered it."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway.auth import authenticate
from flotilla.gateway.batch_jobs.openai_batches import page_limit
from flotilla.gateway.batch_jobs.records import (ANTHROPIC, CANCELLING, ERRORED, IN_PROGRESS, RESULT_TYPES,
                                                 SUCCEEDED, VALIDATING, BatchJob, new_id)
from flotilla.gateway.batch_jobs.service import BatchJobs, batch_jobs
from flotilla.gateway.body import parse_body, read_body
from flotilla.gateway.context import dialect_endpoint, gateway_context
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.schema_base import RequestModel

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_PROCESSING = {VALIDATING: "in_progress", IN_PROGRESS: "in_progress", CANCELLING: "canceling"}


class BatchRequestItem(RequestModel):
    # custom_id is checked by create_batch (its own message); the pattern only describes it in /openapi.json.
    custom_id: str = pydantic.Field(json_schema_extra={"pattern": f"^{CUSTOM_ID.pattern}$"})
    params: dict = pydantic.Field(description="a POST /v1/messages body, checked when the request runs (a bad "
                                  "one is an errored result)")


class CreateMessageBatch(RequestModel):
    requests: list[BatchRequestItem] = pydantic.Field(min_length=1)


def _time(unix_s: float | None) -> str | None:
    if unix_s is None:
        return None
    return datetime.fromtimestamp(unix_s, timezone.utc).isoformat().replace("+00:00", "Z")


async def batch_object(request: Request, jobs: BatchJobs, job: BatchJob) -> dict:
    counts = await jobs.store.result_counts(job.id)
    ended = job.times.get(job.status) if not job.is_active else None
    return {"id": job.id, "type": "message_batch", "processing_status": _PROCESSING.get(job.status, "ended"),
            "request_counts": {"processing": job.num_items - sum(counts.values()),
                               **{kind: counts.get(kind, 0) for kind in RESULT_TYPES}},
            "ended_at": _time(ended), "created_at": _time(job.created_at), "expires_at": _time(job.expires_at),
            "archived_at": None, "cancel_initiated_at": _time(job.times.get(CANCELLING)),
            "results_url": f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{job.id}/results"
                           if ended is not None else None}


@dialect_endpoint(Dialect.ANTHROPIC)
async def create_batch(request: Request) -> Response:
    ctx, jobs = gateway_context(request), batch_jobs(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(CreateMessageBatch, await read_body(request, jobs.settings.max_file_bytes))
    if len(params.requests) > jobs.settings.max_requests:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"a batch takes at most {jobs.settings.max_requests} "
                           f"requests, got {len(params.requests)}", param="requests")
    seen: set[str] = set()
    for i, item in enumerate(params.requests):
        if not CUSTOM_ID.fullmatch(item.custom_id):
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"requests.{i}.custom_id must be 1-64 letters, digits, "
                               "'_' or '-'", param=f"requests.{i}.custom_id")
        if item.custom_id in seen:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"requests.{i}.custom_id {item.custom_id!r} is used more "
                               "than once", param=f"requests.{i}.custom_id")
        seen.add(item.custom_id)
    job = jobs.new_job(new_id("msgbatch_"), ANTHROPIC, principal, "/v1/messages", status=IN_PROGRESS,
                       num_items=len(params.requests))
    await jobs.store.put_items(job.id, [{"custom_id": r.custom_id, "body": r.params} for r in params.requests])
    await jobs.start_job(job)
    return JSONResponse(await batch_object(request, jobs, job))


@dialect_endpoint(Dialect.ANTHROPIC)
async def get_batch(request: Request) -> Response:
    jobs = batch_jobs(request)
    job = await _owned(request, jobs)
    return JSONResponse(await batch_object(request, jobs, job))


@dialect_endpoint(Dialect.ANTHROPIC)
async def list_batches(request: Request) -> Response:
    jobs = batch_jobs(request)
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    query = request.query_params
    limit = page_limit(query.get("limit"), default=20)
    every = await jobs.store.list_jobs(principal.tenant, ANTHROPIC)
    ids = [job.id for job in every]
    start, end = 0, len(every)
    for name in ("after_id", "before_id"):
        cursor = query.get(name)
        if cursor and cursor not in ids:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"{name}: no message batch with id {cursor!r}",
                               param=name)
    if query.get("after_id"):
        start = ids.index(query["after_id"]) + 1
    if query.get("before_id"):
        end = ids.index(query["before_id"])
        start = max(start, end - limit)
    page = every[start:end][:limit]
    data = [await batch_object(request, jobs, job) for job in page]
    has_more = start + len(page) < end if not query.get("before_id") else start > 0
    return JSONResponse({"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None})


@dialect_endpoint(Dialect.ANTHROPIC)
async def cancel_batch(request: Request) -> Response:
    jobs = batch_jobs(request)
    job = await jobs.cancel(await _owned(request, jobs))
    return JSONResponse(await batch_object(request, jobs, job))


@dialect_endpoint(Dialect.ANTHROPIC)
async def batch_results(request: Request) -> Response:
    jobs = batch_jobs(request)
    job = await _owned(request, jobs)
    if job.is_active:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"message batch {job.id} is still processing; its results "
                           "are ready once processing_status is 'ended'")
    items, results = await jobs.store.get_items(job.id), await jobs.store.get_results(job.id)
    lines = []
    for index in sorted(results):
        result = results[index]
        if result.type == SUCCEEDED:
            body = {"type": SUCCEEDED, "message": result.body}
        elif result.type == ERRORED:
            body = {"type": ERRORED, "error": result.body}
        else:
            body = {"type": result.type}
        lines.append(json.dumps({"custom_id": items[index]["custom_id"], "result": body}) + "\n")
    return Response("".join(lines), media_type="application/binary")


async def _owned(request: Request, jobs: BatchJobs) -> BatchJob:
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    return await jobs.owned_job(request.path_params["batch_id"], principal, ANTHROPIC, "message batch")
