"""Request bodies: size limit (declared and actually streamed), JSON parsing and schema validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
import pydantic
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from flotilla.gateway.errors import ClientDisconnected, ErrorKind, GatewayError

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
MAX_REPORTED_ERRORS = 3
MAX_JSON_DEPTH = 64  # a JSON Schema in response_format is the deepest thing a request carries
MAX_TEXT_CHARS = 2 << 20  # all the strings of a body together: refused before the tokenizer sees any of them


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed max_bytes (a chunked body is counted as it comes)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise GatewayError(ErrorKind.INVALID_REQUEST, "invalid Content-Length header")
        if int(declared) > max_bytes:
            raise body_too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    num_bytes = 0
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > max_bytes:
                raise body_too_large(num_bytes, max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as err:
        raise ClientDisconnected() from err
    return b"".join(chunks)


async def read_asgi_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """For middlewares in front of the app: (the body so far, complete). complete is False once it grows past
    `limit` (nothing more is read; the caller answers 413 or lets the app do so) or when the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks), False
        if not message.get("more_body", False):
            return b"".join(chunks), True


def decode_json(body: bytes) -> Any:
    """JSON without recursion: orjson refuses nesting past 1024 levels (Python's json module would overflow the
    stack, a 500), and nothing this API takes nests past MAX_JSON_DEPTH. ValueError for either, and for what
    json would let through but is not JSON (NaN, Infinity, invalid UTF-8)."""
    document = orjson.loads(body)
    depth, level = 0, [document]
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        level = [child for value in level if isinstance(value, (dict, list))
                 for child in (value.values() if isinstance(value, dict) else value)
                 if isinstance(child, (dict, list))]
    return document


def text_chars(document: Any) -> int:
    """Characters in every string of a decoded document, keys included (iterative: no recursion)."""
    total, pending = 0, [document]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            total += sum(len(key) for key in value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return total


def parse_body(schema: type[ModelT], body: bytes, check: Callable[[dict[str, Any]], None] | None = None) -> ModelT:
    """Malformed JSON and schema violations are both 400; `param` names the first offending field. `check`
    (field_support.py) refuses unknown and unsupported fields before the schema sees them."""
    try:
        document = decode_json(body)
    except ValueError as err:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"the request body is not valid JSON: {err}") from err
    if not isinstance(document, dict):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
    if (num_chars := text_chars(document)) > MAX_TEXT_CHARS:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"the request's text totals {num_chars} characters, more "
                           f"than the limit of {MAX_TEXT_CHARS}", code="text_too_long")
    if check is not None:
        check(document)
    try:
        return schema.model_validate(document)
    except pydantic.ValidationError as err:
        raise _schema_error(err) from err


def _schema_error(err: pydantic.ValidationError) -> GatewayError:
    errors = err.errors(include_url=False)
    unknown = next((e for e in errors if e["type"] == "extra_forbidden"), None)
    if unknown is not None:  # a field inside an object that nothing reads: refused, never dropped
        path = _loc(unknown["loc"])
        return GatewayError(ErrorKind.INVALID_REQUEST, f"{path} is not supported: not a field of this object",
                            param=path, code="unsupported_field")
    described = [f"{_loc(e['loc']) or 'body'}: {e['msg']}" for e in errors[:MAX_REPORTED_ERRORS]]
    return GatewayError(ErrorKind.INVALID_REQUEST, "; ".join(described), param=_loc(errors[0]["loc"]) or None)


_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _loc(loc: tuple) -> str:
    # pydantic puts union member names ("str", "list[TextBlock]") into locations; they are not fields.
    return ".".join(str(part) for part in loc
                    if isinstance(part, int) or (part.isidentifier() and part not in _UNION_MEMBER_NAMES))


def body_too_large(num_bytes: int, max_bytes: int) -> GatewayError:
    return GatewayError(ErrorKind.REQUEST_TOO_LARGE,
                        f"request body of {num_bytes} bytes exceeds the limit of {max_bytes} bytes",
                        code="request_too_large")
