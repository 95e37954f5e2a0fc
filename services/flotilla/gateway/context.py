"""Per-app state shared by the handlers, and the per-request values the middleware sets."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flotilla.gateway.connection_limits import StreamSlots, release_stream_slot
from flotilla.gateway.dialects import Dialect, error_response
from flotilla.gateway.errors import ClientDisconnected, ErrorKind, GatewayError
from flotilla.tenancy.keys import KeyStore
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.model_registry import ModelRegistry
from flotilla.gateway.queue_load import QueueLoad
from flotilla.gateway.router_client import RouterBackend
from flotilla.gateway.safety.config import SafetyConfig
from flotilla.gateway.settings import GatewaySettings
from flotilla.tenancy.gatekeeper import Gatekeeper
from flotilla.gateway.telemetry import http_request_span
from flotilla.usage.ledger import UsageLedger

log = logging.getLogger(__name__)

# nginx's "client closed request": logged and counted, never seen by the (gone) client.
CLIENT_CLOSED_STATUS = 499


@dataclass
class GatewayContext:
    settings: GatewaySettings
    backend: RouterBackend
    registry: ModelRegistry
    key_store: KeyStore | None
    metrics: GatewayMetrics
    gatekeeper: Gatekeeper | None = None  # tenancy: keys, quotas, Redis-down policy; None = auth off
    ledger: UsageLedger | None = None  # usage records (usage_meter.py); None = off
    stream_slots: StreamSlots | None = None  # open streams per key (connection_limits.py); None = uncapped
    safety: SafetyConfig | None = None  # safety policies (safety/); None = nothing screened
    queue_load: QueueLoad | None = None  # the router's queue wait, for degradation (queue_load.py); None = off


def gateway_context(request: Request) -> GatewayContext:
    return request.app.state.gateway


def request_id(request: Request) -> str:
    return request.scope["flotilla.request_id"]


def arrival_time(request: Request) -> float:
    return request.scope["flotilla.arrival"]


def dialect_endpoint(dialect: Dialect) -> Callable:
    """Renders GatewayError (and anything unexpected) in the endpoint's dialect."""

    def decorate(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(handler)
        async def endpoint(request: Request) -> Response:
            ctx = gateway_context(request)
            try:
                return await handler(request)
            except GatewayError as err:
                return _rejected(ctx, dialect, err)
            except ClientDisconnected:
                ctx.metrics.cancellations.inc()
                return Response(status_code=CLIENT_CLOSED_STATUS)
            except Exception:
                log.exception("unhandled error in %s (request %s)", request.url.path, request_id(request))
                return _rejected(ctx, dialect, GatewayError(ErrorKind.INTERNAL,
                                                            f"internal error (request {request_id(request)})"))

        endpoint.dialect = dialect  # its error shape, which /openapi.json documents (openapi.py)
        return endpoint

    return decorate


def _rejected(ctx: GatewayContext, dialect: Dialect, err: GatewayError) -> Response:
    ctx.metrics.rejections.labels(err.code or err.kind.name.lower()).inc()
    return error_response(dialect, err, ctx.settings.retry_after_s)


class RequestContextMiddleware:
    """Pure ASGI (a BaseHTTPMiddleware would wrap `receive` and hide client disconnects): gives each
    request an id, returns it as `request-id` and `x-request-id`, and counts responses by route/status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req_{uuid.uuid4().hex}"
        scope["flotilla.request_id"] = rid
        scope["flotilla.arrival"] = time.perf_counter()
        status = CLIENT_CLOSED_STATUS

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"request-id", rid.encode()),
                                      (b"x-request-id", rid.encode()),
                                      *scope.get("flotilla.response_headers", ())]  # rate-limit state
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # The stream's slot is free before its last bytes go out: a client that opens its next stream the
                # moment this one ends must not find the slot still held (a 429 for a stream that has ended).
                release_stream_slot(scope)
            await send(message)

        with http_request_span(scope, rid) as span:  # the root span of the request's trace
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                release_stream_slot(scope)
                route = _route_label(scope)
                self.metrics.requests.labels(route, scope["method"], str(status)).inc()
                self.metrics.request_seconds.labels(route).observe(time.perf_counter() - scope["flotilla.arrival"])
                if span is not None:
                    span.set_attributes({"http.route": route, "http.response.status_code": status})


def _route_label(scope: Scope) -> str:
    # The route template, not the raw path: unknown URLs must not create a label each.
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
