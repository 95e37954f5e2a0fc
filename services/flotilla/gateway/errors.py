"""Gateway errors, one kind per HTTP outcome, and how router and gRPC failures map onto them.

Each kind carries its HTTP status and its error type in both dialects, so a handler raises one
GatewayError and the dialect decides only the body's shape (see dialects.py).
"""

from __future__ import annotations

import enum
import logging

import grpc

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.rpc.stream_events import Error

log = logging.getLogger(__name__)


class ErrorKind(enum.Enum):
    # value: (HTTP status, Anthropic error type, OpenAI error type)
    INVALID_REQUEST = (400, "invalid_request_error", "invalid_request_error")
    AUTHENTICATION = (401, "authentication_error", "invalid_request_error")
    PERMISSION = (403, "permission_error", "invalid_request_error")
    NOT_FOUND = (404, "not_found_error", "invalid_request_error")
    METHOD_NOT_ALLOWED = (405, "invalid_request_error", "invalid_request_error")
    REQUEST_TOO_LARGE = (413, "request_too_large", "invalid_request_error")
    HEADERS_TOO_LARGE = (431, "invalid_request_error", "invalid_request_error")
    RATE_LIMITED = (429, "rate_limit_error", "rate_limit_error")
    INTERNAL = (500, "api_error", "server_error")
    UNAVAILABLE = (503, "api_error", "server_error")
    TIMEOUT = (504, "api_error", "server_error")
    OVERLOADED = (529, "overloaded_error", "server_error")

    @property
    def status(self) -> int:
        return self.value[0]

    @property
    def anthropic_type(self) -> str:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]

    @property
    def is_retryable(self) -> bool:
        return self in (ErrorKind.RATE_LIMITED, ErrorKind.UNAVAILABLE, ErrorKind.OVERLOADED)


class GatewayError(Exception):
    """A request the gateway answers with an error; `param` names the offending field when there is one."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # None: the gateway's default Retry-After for a retryable kind
        self.headers = headers or {}  # extra response headers (rate-limit state)


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; the router call has been cancelled."""


_ROUTER_CODES = {
    common.ERROR_CODE_INVALID_REQUEST: (ErrorKind.INVALID_REQUEST, None),
    common.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: (ErrorKind.INVALID_REQUEST, "context_length_exceeded"),
    common.ERROR_CODE_MODEL_NOT_FOUND: (ErrorKind.NOT_FOUND, "model_not_found"),
    common.ERROR_CODE_OVERLOADED: (ErrorKind.OVERLOADED, "overloaded"),
    common.ERROR_CODE_UNAVAILABLE: (ErrorKind.UNAVAILABLE, "unavailable"),
    common.ERROR_CODE_DEADLINE_EXCEEDED: (ErrorKind.TIMEOUT, "deadline_exceeded"),
    common.ERROR_CODE_INTERNAL: (ErrorKind.INTERNAL, None),
    common.ERROR_CODE_MODEL_STARTING: (ErrorKind.UNAVAILABLE, "model_starting"),
}

_GRPC_CODES = {
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.TIMEOUT,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_REQUEST,
}


# Errors about the fleet itself: their text names workers, versions (weight digests) and gRPC statuses, which are
# the operator's business. The client gets this, with the request id to quote; the detail goes to the log.
_FLEET_FAULTS = {
    ErrorKind.INTERNAL: "the model's workers failed this request",
    ErrorKind.UNAVAILABLE: "no worker could take this request; retry later",
    ErrorKind.NOT_FOUND: "model not found: it is not, or no longer, served",
}


def error_from_router(error: Error, request_id: str = "") -> GatewayError:
    kind, code = _ROUTER_CODES.get(error.code, (ErrorKind.INTERNAL, None))
    message = error.message or f"router error {common.ErrorCode.Name(error.code)}"
    # A cold start's message is meant for the client ("model 'x' is starting ..."): it names nothing internal.
    generic = _FLEET_FAULTS.get(kind) if error.code != common.ERROR_CODE_MODEL_STARTING else None
    if generic is not None:
        log.warning("request %s: %s from the fleet: %s", request_id or "-", kind.name, message)
        message = f"{generic} (request {request_id})" if request_id else generic
    return GatewayError(kind, message, param=error.field or None, code=code,
                        retry_after_s=error.retry_after_s or None)


def error_from_grpc(err: grpc.RpcError, request_id: str = "") -> GatewayError:
    """A failed call to the router. Its status and details (which can name workers and versions) go to the log
    with the request id; the client gets the kind and that id."""
    status = err.code() if hasattr(err, "code") else None
    kind = _GRPC_CODES.get(status, ErrorKind.INTERNAL)
    details = err.details() if hasattr(err, "details") else str(err)
    log.warning("request %s: router call failed: %s %s", request_id or "-", status, details)
    if kind is ErrorKind.UNAVAILABLE:
        return GatewayError(kind, "the router is unavailable; retry later", code="unavailable")
    suffix = f" (request {request_id})" if request_id else ""
    return GatewayError(kind, _GRPC_MESSAGES.get(kind, "the request failed inside the fleet") + suffix)


_GRPC_MESSAGES = {
    ErrorKind.OVERLOADED: "the fleet is overloaded; retry later",
    ErrorKind.TIMEOUT: "the request's deadline passed inside the fleet",
    ErrorKind.NOT_FOUND: "model not found: it is not, or no longer, served",
    ErrorKind.INVALID_REQUEST: "the fleet refused this request as invalid",
}
