"""Error bodies in each API dialect's own shape. The status and Retry-After come from the error kind."""

from __future__ import annotations

import enum
import math

from starlette.responses import JSONResponse

from flotilla.gateway.errors import ErrorKind, GatewayError


class Dialect(enum.Enum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"


def dialect_for_path(path: str) -> Dialect:
    return Dialect.ANTHROPIC if path.startswith("/v1/messages") else Dialect.OPENAI


def error_body(dialect: Dialect, err: GatewayError) -> dict:
    if dialect is Dialect.ANTHROPIC:
        return {"type": "error", "error": {"type": err.kind.anthropic_type, "message": err.message}}
    return {"error": {"message": err.message, "type": err.kind.openai_type, "param": err.param, "code": err.code}}


def error_response(dialect: Dialect, err: GatewayError, retry_after_s: int) -> JSONResponse:
    headers = dict(err.headers)
    if err.kind.is_retryable:
        seconds = err.retry_after_s if err.retry_after_s is not None else retry_after_s
        headers["retry-after"] = str(max(0, math.ceil(seconds)))
    return JSONResponse(error_body(dialect, err), status_code=err.kind.status, headers=headers or None)


def http_error(status: int, method: str, path: str) -> GatewayError:
    """A routing failure (unknown URL, wrong method) as a GatewayError."""
    if status == 405:
        return GatewayError(ErrorKind.METHOD_NOT_ALLOWED, f"method {method} not allowed for {path}",
                            code="method_not_allowed")
    if status == 404:
        return GatewayError(ErrorKind.NOT_FOUND, f"unknown request URL: {method} {path}", code="unknown_url")
    kind = next((k for k in ErrorKind if k.status == status), ErrorKind.INVALID_REQUEST if status < 500
                else ErrorKind.INTERNAL)
    return GatewayError(kind, f"{method} {path} failed with status {status}")
