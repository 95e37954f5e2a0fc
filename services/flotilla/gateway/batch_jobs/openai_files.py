"""OpenAI's Files API, for batch input: POST /v1/files (multipart, purpose `batch`, a JSONL file within the size
and line limits), GET /v1/files (the tenant's files: `purpose`, `limit`, `order`, `after`), GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}. Output and error files of finished jobs (purpose
`batch_output`) are read the same way. Files are the tenant's: another tenant's id is a 404."""

from __future__ import annotations

import time

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway.auth import authenticate
from flotilla.gateway.batch_jobs.openai_batches import page_limit
from flotilla.gateway.batch_jobs.records import StoredFile, new_id
from flotilla.gateway.batch_jobs.service import batch_jobs
from flotilla.gateway.batch_jobs.settings import BatchSettings
from flotilla.gateway.batch_jobs.store import UnknownCursor
from flotilla.gateway.body import read_body
from flotilla.gateway.context import dialect_endpoint, gateway_context
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import ErrorKind, GatewayError

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # boundaries, part headers and the purpose field around the file
MAX_LIST_LIMIT = 10_000  # OpenAI's bound on GET /v1/files?limit, and its default
ORDERS = ("asc", "desc")


def file_object(meta: StoredFile) -> dict:
    return {"id": meta.id, "object": "file", "bytes": meta.bytes, "created_at": int(meta.created_at),
            "filename": meta.filename, "purpose": meta.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


@dialect_endpoint(Dialect.OPENAI)
async def upload_file(request: Request) -> Response:
    ctx, jobs = gateway_context(request), batch_jobs(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    limit = jobs.settings.max_file_bytes
    body = await read_body(request, limit + MULTIPART_OVERHEAD_BYTES)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "upload the file as multipart/form-data (fields file, purpose)")
    form = await _form(request, body, limit)
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise GatewayError(ErrorKind.INVALID_REQUEST, "purpose must be 'batch' (the only files this API keeps)",
                           param="purpose")
    if not isinstance(upload, UploadFile):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "file: Field required (a multipart file part)", param="file")
    content = await upload.read()
    _check_jsonl(content, jobs.settings)
    meta = StoredFile(new_id("file-"), principal.tenant, upload.filename or "upload.jsonl", "batch", len(content),
                      time.time())
    await jobs.store.put_file(meta, content)
    return JSONResponse(file_object(meta))


async def _form(request: Request, body: bytes, limit: int):
    """The multipart form of a body already read (and bounded) by read_body."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        return await Request(request.scope, replay).form(max_files=1, max_fields=4, max_part_size=limit)
    except MultiPartException as err:  # starlette's, for python-multipart's parse errors and the limits
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"malformed multipart body: {err}") from err
    except HTTPException as err:  # the same, as starlette raises them for a scope with an app (always, here)
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"malformed multipart body: {err.detail}") from err


def _check_jsonl(content: bytes, settings: BatchSettings) -> None:
    if len(content) > settings.max_file_bytes:
        raise GatewayError(ErrorKind.REQUEST_TOO_LARGE, f"the file is over {settings.max_file_bytes} bytes",
                           param="file")
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as err:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the file must be UTF-8 JSONL", param="file") from err
    lines = [line for line in content.splitlines() if line.strip()]
    if not lines:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the file has no lines", param="file")
    if len(lines) > settings.max_requests:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"the file has {len(lines)} lines; a batch takes at most "
                           f"{settings.max_requests} requests", param="file")
    longest = max(len(line) for line in lines)
    if longest > settings.max_line_bytes:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"a line is {longest} bytes; the limit is "
                           f"{settings.max_line_bytes}", param="file")


@dialect_endpoint(Dialect.OPENAI)
async def list_files(request: Request) -> Response:
    """By created_at, newest first unless order=asc; `after` is the last id of the previous page."""
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    query = request.query_params
    limit = page_limit(query.get("limit"), default=MAX_LIST_LIMIT, maximum=MAX_LIST_LIMIT)
    order = query.get("order", "desc")
    if order not in ORDERS:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "order must be 'asc' or 'desc'", param="order")
    after = query.get("after") or None
    try:
        files, has_more = await batch_jobs(request).store.list_files(principal.tenant, query.get("purpose") or None,
                                                                     order == "desc", after, limit)
    except UnknownCursor:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"after: no file with id {after!r} in this listing",
                           param="after") from None
    data = [file_object(meta) for meta in files]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@dialect_endpoint(Dialect.OPENAI)
async def get_file(request: Request) -> Response:
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    meta = await batch_jobs(request).owned_file(request.path_params["file_id"], principal)
    return JSONResponse(file_object(meta))


@dialect_endpoint(Dialect.OPENAI)
async def file_content(request: Request) -> Response:
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    jobs = batch_jobs(request)
    meta = await jobs.owned_file(request.path_params["file_id"], principal)
    content = await jobs.store.file_content(meta.id)
    if content is None:
        raise GatewayError(ErrorKind.NOT_FOUND, f"no file with id {meta.id!r}", param="file_id")
    return Response(content, media_type="application/jsonl")


@dialect_endpoint(Dialect.OPENAI)
async def delete_file(request: Request) -> Response:
    principal = await authenticate(request.headers, gateway_context(request).gatekeeper)
    jobs = batch_jobs(request)
    meta = await jobs.owned_file(request.path_params["file_id"], principal)
    deleted = await jobs.store.delete_file(meta.id)
    return JSONResponse({"id": meta.id, "object": "file", "deleted": deleted})
