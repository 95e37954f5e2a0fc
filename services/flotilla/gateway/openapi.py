"""GET /openapi.json: the OpenAPI 3.1 description of the whole HTTP API, generated from the app itself.

FastAPI lists every route the app has (a route added later appears by itself, with the auth schemes and its
dialect's error responses); OPERATIONS adds what FastAPI cannot see, because the handlers read their bodies
themselves (body.py): the request schema (the pydantic models, bounds included, with each field's support
status from field_support.py), the success bodies (openapi_shapes.py) and the headers a route reads. Routes
served by middlewares (resumable stream reconnects) are added from MIDDLEWARE_PATHS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from flotilla.engine.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from flotilla.gateway import field_support
from flotilla.gateway import openapi_shapes as shapes
from flotilla.gateway.admission import DEADLINE_HEADER, MAX_DEADLINE_DIGITS
from flotilla.gateway.anthropic_schema import CountTokensRequest, MessagesRequest
from flotilla.gateway.auth import PRIORITY_HEADER
from flotilla.gateway.batch_api import BatchGenerateRequest
from flotilla.gateway.batch_jobs.anthropic_batches import CreateMessageBatch
from flotilla.gateway.batch_jobs.openai_batches import MAX_PAGE, CreateBatchRequest
from flotilla.gateway.batch_jobs.openai_files import MAX_LIST_LIMIT, ORDERS
from flotilla.gateway.degradation import DEGRADED_HEADER
from flotilla.gateway.dialects import Dialect, dialect_for_path
from flotilla.gateway.errors import ErrorKind
from flotilla.gateway.idempotency import MAX_KEY_LENGTH
from flotilla.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from flotilla.gateway.safety.moderations_api import ModerationRequest
from flotilla.tenancy.records import PRIORITY_CLASSES

OPENAPI_PATH = "/openapi.json"
SECURITY_SCHEMES = {
    "bearerAuth": {"type": "http", "scheme": "bearer",
                   "description": "Authorization: Bearer <API key> (OpenAI style)"},
    "apiKeyAuth": {"type": "apiKey", "in": "header", "name": "x-api-key",
                   "description": "the API key (Anthropic style)"},
}
SECURITY = [{"bearerAuth": []}, {"apiKeyAuth": []}]
ALL_ERRORS = tuple(sorted({kind.status for kind in ErrorKind if kind is not ErrorKind.METHOD_NOT_ALLOWED}))
LOOKUP_ERRORS = (400, 401, 403, 404, 500, 503)  # what GET routes behind authentication can answer
PROBE_ERRORS = (503,)
IDEMPOTENCY_ERRORS = (409, 422)  # idempotency.py: the key's first request still runs / had another body
BATCH_CREATE_ERRORS = (400, 401, 403, 413, 500, 503)  # batch_jobs/: authenticate, read_body, the checks


@dataclass(frozen=True)
class Operation:
    summary: str
    request: type[BaseModel] | None = None  # a JSON body of this model; None: the handler reads no body
    response: dict = field(default_factory=lambda: {"type": "object"})
    streams: bool = False  # with "stream": true the answer is text/event-stream
    errors: tuple[int, ...] = ALL_ERRORS
    authenticated: bool = True
    headers: tuple[str, ...] = ()  # names in HEADERS
    fields: dict[str, field_support.Status] | None = None  # the field_support table for the request's fields
    example: dict | None = None  # a valid body (without "model": the gateway's --default-model, if it has one)
    response_type: str = "application/json"  # the success body's media type
    form: dict | None = None  # a multipart/form-data body of this schema (instead of `request`)
    query: tuple[str, ...] = ()  # names in QUERY


_CHAT_EXAMPLE = {"max_tokens": 8, "messages": [{"role": "user", "content": "Say hello"}]}
def _any_case(words: tuple[str, ...]) -> str:
    """A pattern matching `words` in any letter case (JSON Schema patterns have no case-insensitive flag)."""
    return "^(" + "|".join("".join(f"[{c.lower()}{c.upper()}]" for c in word) for word in words) + ")$"


# Header values as the gateway parses them (surrounding whitespace stripped first: connection_limits.py).
HEADERS = {
    "idempotency-key": {"name": "Idempotency-Key", "description": "replays the stored answer of an earlier "
                        "request with the same key (per API key); ignored by streamed requests and when empty",
                        "schema": {"type": "string", "maxLength": MAX_KEY_LENGTH}},
    "priority": {"name": PRIORITY_HEADER, "description": "serve as this priority class; may only lower the key's",
                 "schema": {"type": "string", "pattern": _any_case(PRIORITY_CLASSES)}},
    "deadline": {"name": DEADLINE_HEADER, "description": "the request's deadline in milliseconds (> 0)",
                 "schema": {"type": "string", "pattern": f"^(?=[0-9]{{1,{MAX_DEADLINE_DIGITS}}}$)0*[1-9][0-9]*$"}},
    "resumable": {"name": "x-flotilla-resumable", "description": "true, 1 or yes (any case): a streamed answer "
                  "survives a dropped connection for the grace period (GET /v1/streams/{stream_id} resumes it); "
                  "any other value: it does not", "schema": {"type": "string"}},
}
GENERATION_HEADERS = ("idempotency-key", "priority", "deadline", "resumable")

# Query parameters of the batch lists, as batch_jobs/ parses them (an unknown cursor is a 400).
_PAGE_LIMIT = {"name": "limit", "description": "page size (default 20)",
               "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}
QUERY = {
    "limit": _PAGE_LIMIT,
    "after": {"name": "after", "description": "the id of the last batch of the previous page",
              "schema": {"type": "string"}},
    "after_id": {"name": "after_id", "description": "the page after this message batch id",
                 "schema": {"type": "string"}},
    "before_id": {"name": "before_id", "description": "the page before this message batch id",
                  "schema": {"type": "string"}},
    "file_limit": {"name": "limit", "description": f"page size (default {MAX_LIST_LIMIT})",
                   "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT}},
    "file_after": {"name": "after", "description": "the id of the last file of the previous page",
                   "schema": {"type": "string"}},
    "order": {"name": "order", "description": "by created_at (default desc: newest first)",
              "schema": {"enum": list(ORDERS)}},
    "purpose": {"name": "purpose", "description": "only files of this purpose (batch, batch_output)",
                "schema": {"type": "string"}},
}
_BATCH_LINE = {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
               "body": {"max_tokens": 8, "messages": [{"role": "user", "content": "Say hello"}]}}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation("Chat completion (OpenAI)", ChatCompletionRequest,
                                                shapes.CHAT_COMPLETION, True, headers=GENERATION_HEADERS,
                                                fields=field_support.CHAT_FIELDS, example=_CHAT_EXAMPLE),
    ("POST", "/v1/completions"): Operation("Text completion (OpenAI)", CompletionRequest, shapes.COMPLETION, True,
                                           headers=GENERATION_HEADERS, fields=field_support.COMPLETION_FIELDS,
                                           example={"prompt": "Once upon a time", "max_tokens": 8}),
    ("POST", "/v1/messages"): Operation("Message (Anthropic)", MessagesRequest, shapes.MESSAGE, True,
                                        headers=GENERATION_HEADERS, fields=field_support.MESSAGES_FIELDS,
                                        example=_CHAT_EXAMPLE),
    ("POST", "/v1/messages/count_tokens"): Operation("Count a prompt's tokens (Anthropic)", CountTokensRequest,
                                                     shapes.COUNT_TOKENS, headers=("priority",),
                                                     fields=field_support.COUNT_TOKENS_FIELDS,
                                                     example={"messages": _CHAT_EXAMPLE["messages"]}),
    ("POST", "/v1/batch-generate"): Operation("One input through a fixed-batch model", BatchGenerateRequest,
                                              shapes.BATCH_GENERATION, headers=("idempotency-key", "priority",
                                                                                "deadline"),
                                              example={"input": "hello"}),
    ("POST", "/v1/moderations"): Operation("Check text with the caller's safety policy (OpenAI moderation shape)",
                                           ModerationRequest, shapes.MODERATION,
                                           example={"input": ["a text to check"]}),
    ("GET", "/v1/models"): Operation("The served models", response=shapes.MODEL_LIST, errors=LOOKUP_ERRORS,
                                     headers=("priority",)),
    ("GET", "/v1/models/{model_id}"): Operation("One served model, by name or alias", response=shapes.MODEL,
                                                errors=LOOKUP_ERRORS, headers=("priority",)),
    ("POST", "/v1/files"): Operation("Upload a JSONL batch input file (OpenAI)", response=shapes.FILE,
                                     form=shapes.FILE_UPLOAD, errors=BATCH_CREATE_ERRORS,
                                     example={"purpose": "batch", "file": json.dumps(_BATCH_LINE) + "\n"}),
    ("GET", "/v1/files"): Operation("The caller's files (OpenAI)", response=shapes.FILE_LIST, errors=LOOKUP_ERRORS,
                                    query=("purpose", "file_limit", "order", "file_after")),
    ("GET", "/v1/files/{file_id}"): Operation("One file (OpenAI)", response=shapes.FILE, errors=LOOKUP_ERRORS),
    ("DELETE", "/v1/files/{file_id}"): Operation("Delete a file (OpenAI)", response=shapes.FILE_DELETED,
                                                 errors=LOOKUP_ERRORS),
    ("GET", "/v1/files/{file_id}/content"): Operation("A file's content: an upload, or a batch's output or error "
                                                      "file (OpenAI)", response=shapes.JSONL,
                                                      response_type="application/jsonl", errors=LOOKUP_ERRORS),
    ("POST", "/v1/batches"): Operation("Create a batch job from an uploaded file (OpenAI)", CreateBatchRequest,
                                       shapes.BATCH, errors=BATCH_CREATE_ERRORS, headers=("idempotency-key",),
                                       example={"input_file_id": "file-abc", "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}),
    ("GET", "/v1/batches"): Operation("The caller's batch jobs, newest first (OpenAI)", response=shapes.BATCH_LIST,
                                      errors=LOOKUP_ERRORS, query=("limit", "after")),
    ("GET", "/v1/batches/{batch_id}"): Operation("One batch job (OpenAI)", response=shapes.BATCH,
                                                 errors=LOOKUP_ERRORS),
    ("POST", "/v1/batches/{batch_id}/cancel"): Operation("Cancel a batch job (OpenAI; 400 once it has ended)",
                                                         response=shapes.BATCH, errors=LOOKUP_ERRORS),
    ("POST", "/v1/messages/batches"): Operation("Create a message batch (Anthropic)", CreateMessageBatch,
                                                shapes.MESSAGE_BATCH, errors=BATCH_CREATE_ERRORS,
                                                headers=("idempotency-key",),
                                                example={"requests": [{"custom_id": "request-1",
                                                                       "params": _CHAT_EXAMPLE}]}),
    ("GET", "/v1/messages/batches"): Operation("The caller's message batches, newest first (Anthropic)",
                                               response=shapes.MESSAGE_BATCH_LIST, errors=LOOKUP_ERRORS,
                                               query=("limit", "after_id", "before_id")),
    ("GET", "/v1/messages/batches/{batch_id}"): Operation("One message batch (Anthropic)",
                                                          response=shapes.MESSAGE_BATCH, errors=LOOKUP_ERRORS),
    ("POST", "/v1/messages/batches/{batch_id}/cancel"): Operation("Cancel a message batch (Anthropic; an ended "
                                                                  "one is answered as it is)",
                                                                  response=shapes.MESSAGE_BATCH,
                                                                  errors=LOOKUP_ERRORS),
    ("GET", "/v1/messages/batches/{batch_id}/results"): Operation("An ended message batch's results (Anthropic; "
                                                                  "400 while it processes)",
                                                                  response=shapes.MESSAGE_BATCH_RESULTS,
                                                                  response_type="application/binary",
                                                                  errors=LOOKUP_ERRORS),
    ("GET", "/healthz"): Operation("Liveness", response=shapes.HEALTH, errors=PROBE_ERRORS, authenticated=False),
    ("GET", "/readyz"): Operation("Readiness: the router answers and serves a model", response=shapes.HEALTH,
                                  errors=PROBE_ERRORS, authenticated=False),
    ("GET", OPENAPI_PATH): Operation("This description", response={"type": "object"}, errors=PROBE_ERRORS,
                                     authenticated=False),
    ("GET", "/v1/streams/{stream_id}"): Operation("Resume a resumable stream (Last-Event-ID: after that event)",
                                                  response=shapes.SSE, errors=(401, 404, 413, 503)),
}
MIDDLEWARE_PATHS = (("GET", "/v1/streams/{stream_id}"),)  # resumable.py, in front of the app
_PATH_PARAM = re.compile(r"{([^}:]+)(?::[^}]*)?}")


def install(app: FastAPI) -> None:
    """Serves the description at app.openapi_url (FastAPI's own route), built on its first request, when every
    route has been added."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi


def build(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title="Flotilla gateway", version="1", openapi_version="3.1.0", routes=app.routes,
                           description=_DESCRIPTION)
    paths = document.setdefault("paths", {})
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.update(_request_schemas())
    batch_jobs = getattr(app.state, "batch_jobs", None)
    if batch_jobs is not None:  # this gateway's --batch-max-requests
        schemas["CreateMessageBatch"]["properties"]["requests"]["maxItems"] = batch_jobs.settings.max_requests
    schemas["OpenAIError"], schemas["AnthropicError"] = shapes.OPENAI_ERROR, shapes.ANTHROPIC_ERROR
    components["securitySchemes"] = SECURITY_SCHEMES
    for method, path, dialect in [*_app_operations(app), *_middleware_operations(), ("GET", OPENAPI_PATH,
                                                                                     Dialect.OPENAI)]:
        operation = paths.setdefault(path, {}).setdefault(method.lower(), {})
        _describe(operation, method, path, dialect)
    return document


def _app_operations(app: FastAPI) -> list[tuple[str, str, Dialect]]:
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute) and route.include_in_schema:
            dialect = getattr(route.endpoint, "dialect", None) or dialect_for_path(route.path)
            found += [(method, _openapi_path(route.path), dialect) for method in sorted(route.methods)]
    return found


def _middleware_operations() -> list[tuple[str, str, Dialect]]:
    return [(method, path, dialect_for_path(path)) for method, path in MIDDLEWARE_PATHS]


def _openapi_path(path: str) -> str:
    return _PATH_PARAM.sub(r"{\1}", path)  # {model_id:path} -> {model_id}


def _describe(operation: dict, method: str, path: str, dialect: Dialect) -> None:
    spec = OPERATIONS.get((method, path))
    operation.setdefault("operationId", f"{method.lower()}_{re.sub(r'[^a-z0-9]+', '_', path.lower()).strip('_')}")
    parameters = [p for p in operation.get("parameters", []) if p.get("in") != "path"]
    parameters += [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
                   for name in _PATH_PARAM.findall(path)]
    responses = operation.setdefault("responses", {})
    error_ref = {"$ref": f"#/components/schemas/{'AnthropicError' if dialect is Dialect.ANTHROPIC else 'OpenAIError'}"}
    if spec is not None:
        operation["summary"] = spec.summary
        parameters += [{**HEADERS[name], "in": "header", "required": False} for name in spec.headers]
        parameters += [{**QUERY[name], "in": "query", "required": False} for name in spec.query]
        if spec.request is not None or spec.form is not None:
            media_type = "application/json" if spec.form is None else "multipart/form-data"
            schema = spec.form or {"$ref": f"#/components/schemas/{spec.request.__name__}"}
            body = {"schema": schema} if spec.example is None else {"schema": schema, "example": spec.example}
            operation["requestBody"] = {"required": True, "content": {media_type: body}}
        content = {spec.response_type: {"schema": spec.response}} if spec.response is not shapes.SSE else {}
        if spec.streams or spec.response is shapes.SSE:
            content["text/event-stream"] = {"schema": shapes.SSE}
        responses.clear()
        responses["200"] = {"description": "OK", "content": content}
        if spec.streams:  # the generation routes: degradation under load (degradation.py)
            responses["200"]["headers"] = {DEGRADED_HEADER: {
                "schema": {"type": "string"}, "description": "present when the fleet was overloaded and this "
                "free-tier request was degraded: what applied, e.g. `max_tokens=64; tokens_per_minute=7500`"}}
        errors = spec.errors
        if "idempotency-key" in spec.headers:
            errors = tuple(sorted({*errors, *IDEMPOTENCY_ERRORS}))
        if spec.authenticated:
            operation["security"] = SECURITY
    else:
        errors = ALL_ERRORS
        operation["security"] = SECURITY
    for status in errors:
        error = {"description": _STATUS_TEXT[status], "content": {"application/json": {"schema": error_ref}}}
        if spec is not None and not spec.authenticated and status == 503:  # a probe's own 503 body, or the limit's
            error["content"]["application/json"]["schema"] = {"anyOf": [shapes.HEALTH, error_ref]}
        if ErrorKind.RATE_LIMITED.status == status or status in (503, 529):
            error["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        responses[str(status)] = error
    if parameters:
        operation["parameters"] = parameters


def _request_schemas() -> dict[str, Any]:
    models = [op.request for op in OPERATIONS.values() if op.request is not None]
    _, top = models_json_schema([(model, "validation") for model in models],
                                ref_template="#/components/schemas/{model}")
    defs = top.get("$defs", {})
    for op in OPERATIONS.values():
        if op.request is not None:
            properties = defs[op.request.__name__].get("properties", {})
            for name, status in (op.fields or {}).items():
                if name in properties:
                    properties[name]["description"] = field_support.describe(status)
            for name, bounds in ENGINE_BOUNDS.items():
                if name in properties:
                    _bound(properties[name], bounds)
    return defs


_STOP_STRING = {"minLength": 1, "maxLength": MAX_STOP_LENGTH}
# Bounds the engine's SamplingParams.validate enforces (a 400 naming the field) rather than the pydantic models:
# by JSON type, for each member of a union.
ENGINE_BOUNDS: dict[str, dict[str, dict]] = {
    "max_tokens": {"integer": {"minimum": 1}},
    "max_completion_tokens": {"integer": {"minimum": 1}},
    "seed": {"integer": {"minimum": 0, "maximum": 2**63 - 1}},
    "stop": {"string": _STOP_STRING, "array": {"maxItems": MAX_STOP_STRINGS, "items": {"type": "string",
                                                                                        **_STOP_STRING}}},
    "stop_sequences": {"array": {"maxItems": MAX_STOP_STRINGS, "items": {"type": "string", **_STOP_STRING}}},
}


def _bound(schema: dict, bounds: dict[str, dict]) -> None:
    for member in schema.get("anyOf", [schema]):
        extra = bounds.get(member.get("type"))
        if extra is not None:
            member.update(extra)


_STATUS_TEXT = {400: "Invalid request", 401: "Missing or invalid API key", 403: "Not permitted for this key",
                404: "Unknown model, URL or stream", 409: "A request with this Idempotency-Key is still running",
                413: "Request body too large", 422: "This Idempotency-Key was used with another body",
                429: "Rate limited", 431: "Request line and headers too large",
                500: "Internal error", 503: "Unavailable (router, key store, or the gateway's limit of requests "
                "in flight)", 504: "Deadline exceeded", 529: "Overloaded"}

_DESCRIPTION = """OpenAI- and Anthropic-compatible inference API. Routes under /v1/messages answer errors in
Anthropic's shape, every other route in OpenAI's. Authenticate with `Authorization: Bearer <key>` or
`x-api-key: <key>` (both name the same keys); a gateway started with --no-auth takes requests without one."""
