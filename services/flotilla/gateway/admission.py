"""Tenant admission in the gateway: reserve quota before routing, settle (refund) after, rate-limit
headers in the dialect's style, and the request's class, deadline and wait budget for the router.

The router decides 529 (fleet overload) from the wait budget sent here; this module decides 429 (the
tenant's own quota) and 503 (Redis down while failing closed). Before either, a free-tier request may be
degraded while the router's queue is long (degradation.py): a smaller max_tokens, a tighter token quota. A batch
job's item is charged at the batch rate (its principal's price factor, usage/pricing.py), reserved and settled.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from starlette.requests import Request

from flotilla.engine.request import FinishReason, Priority
from flotilla.gateway.auth import HTTP_WHITESPACE, Principal
from flotilla.gateway.degradation import DEGRADED_HEADER, Degradation, plan
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.safety.filtered import Filtered, Withheld
from flotilla.rpc.stream_events import Chunk, Finished, StreamEvent
from flotilla.tenancy.errors import BackendUnavailable
from flotilla.tenancy.admission_policy import AdmissionPolicy
from flotilla.tenancy.gatekeeper import Gatekeeper, QuotaExceeded, Reservation
from flotilla.tenancy.headers import anthropic_headers, openai_headers
from flotilla.tenancy.quota import QuotaState, Reason
from flotilla.usage.pricing import charged_tokens

DEADLINE_HEADER = "x-flotilla-deadline-ms"
MAX_DEADLINE_DIGITS = 9  # under 12 days
RESPONSE_HEADERS_SCOPE_KEY = "flotilla.response_headers"  # sent by RequestContextMiddleware
_PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
_REFUSALS = {Reason.TOKENS: "tokens per minute", Reason.REQUESTS: "requests per minute",
             Reason.CONCURRENCY: "concurrent requests"}


@dataclass(frozen=True)
class RouteTicket:
    """What the router needs to queue the request fairly and to shed it when the fleet is overloaded."""

    priority: Priority
    deadline_unix_s: float  # 0 = none
    max_queue_wait_s: float
    tenant_weight: int
    max_tokens_cap: int = 0  # a degraded request's max_tokens (degradation.py); 0 = as asked


@dataclass(frozen=True)
class Admitted:
    ticket: RouteTicket
    reservation: Reservation | None
    gatekeeper: Gatekeeper | None
    num_prompt_tokens: int
    price_factor: float = 1.0  # the principal's: tokens are charged times this

    def settlement(self) -> QuotaSettlement | None:
        """The tap on the request's router stream that settles its reservation; None without a gatekeeper."""
        if self.gatekeeper is None or self.reservation is None:
            return None
        return QuotaSettlement(self.gatekeeper, self.reservation, self.num_prompt_tokens, self.price_factor)


async def admit(request: Request, gatekeeper: Gatekeeper | None, policy: AdmissionPolicy, dialect: Dialect,
                principal: Principal, request_id: str, num_prompt_tokens: int, max_tokens: int,
                model: str = "") -> Admitted:
    """`model`: the served model's name, whose queue load may degrade a free-tier request ("": never)."""
    degradation = _degradation(request, policy, principal, model, num_prompt_tokens, max_tokens)
    limits = principal.limits
    ticket = route_ticket(request, policy, principal)
    if degradation is not None:
        max_tokens, limits = degradation.max_tokens, degradation.limits
        ticket = replace(ticket, max_tokens_cap=degradation.max_tokens)
        request.scope[RESPONSE_HEADERS_SCOPE_KEY] = [*request.scope.get(RESPONSE_HEADERS_SCOPE_KEY, ()),
                                                     _degraded_header(degradation)]
    if gatekeeper is None:
        return Admitted(ticket, None, None, num_prompt_tokens)
    charged = charged_tokens(num_prompt_tokens + max_tokens, principal.price_factor)
    try:
        reservation = await gatekeeper.reserve(principal.tenant, limits, request_id, charged)
    except QuotaExceeded as refused:  # a degraded request's 429 carries its header too (set in the scope)
        raise _quota_error(refused, dialect, num_prompt_tokens + max_tokens, charged) from None
    except BackendUnavailable as err:
        raise GatewayError(ErrorKind.UNAVAILABLE, "the quota store is unavailable; retry later",
                           code="unavailable") from err
    if reservation.decision is not None:
        request.scope[RESPONSE_HEADERS_SCOPE_KEY] = [*request.scope.get(RESPONSE_HEADERS_SCOPE_KEY, ()),
                                                     *_header_list(dialect, reservation.decision.state)]
    return Admitted(ticket, reservation, gatekeeper, num_prompt_tokens, principal.price_factor)


def _degradation(request: Request, policy: AdmissionPolicy, principal: Principal, model: str,
                 num_prompt_tokens: int, max_tokens: int) -> Degradation | None:
    ctx = request.app.state.gateway if model else None
    if ctx is None or ctx.queue_load is None:
        return None
    wait_s = ctx.queue_load.wait_s(model)  # read for every request: it keeps the model polled
    # Batch-class requests (a batch job's items too) wait or are shed, never cut short: their output is the job's.
    if principal.priority_class != "interactive":
        return None
    degradation = plan(ctx.settings.degradation, policy, principal.tier, wait_s, num_prompt_tokens, max_tokens,
                       principal.limits)
    if degradation is not None:
        ctx.metrics.degraded_requests.labels(model, "max_tokens" if degradation.max_tokens < max_tokens
                                             else "quota").inc()
    return degradation


def _degraded_header(degradation: Degradation) -> tuple[bytes, bytes]:
    return DEGRADED_HEADER.encode("latin-1"), degradation.header_value.encode("latin-1")


def route_ticket(request: Request, policy: AdmissionPolicy, principal: Principal) -> RouteTicket:
    deadline_s = _requested_deadline_s(request) or policy.deadline_s(principal.tier)
    return RouteTicket(_PRIORITIES[principal.priority_class], time.time() + deadline_s if deadline_s else 0.0,
                       policy.budget_s(principal.tier, principal.priority_class), policy.weight(principal.tier))


def _requested_deadline_s(request: Request) -> float:
    value = request.headers.get(DEADLINE_HEADER)
    if value is None:
        return 0.0
    # Checked as text first: int() of thousands of digits is slow or refused, and "١٢" is a digit to isdigit().
    value = value.strip(HTTP_WHITESPACE)
    if not 1 <= len(value) <= MAX_DEADLINE_DIGITS or not value.isascii() or not value.isdigit() or int(value) == 0:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{DEADLINE_HEADER} must be a positive integer of at most "
                           f"{MAX_DEADLINE_DIGITS} digits (milliseconds)", param=DEADLINE_HEADER)
    return int(value) / 1000


def _quota_error(refused: QuotaExceeded, dialect: Dialect, num_tokens: int, num_charged: int) -> GatewayError:
    decision = refused.decision
    if decision.reason == Reason.TOO_LARGE:
        limit = decision.state.limits.tokens_per_minute
        counted = f"{num_tokens}" if num_charged == num_tokens else f"{num_tokens}, {num_charged} at the batch rate"
        return GatewayError(ErrorKind.INVALID_REQUEST, f"prompt + max_tokens ({counted}) exceeds this key's "
                            f"limit of {limit} tokens per minute", param="max_tokens", code="rate_limit_exceeded")
    what = _REFUSALS.get(decision.reason, decision.reason)
    retry_s = max(1, math.ceil(decision.retry_after_s))
    return GatewayError(ErrorKind.RATE_LIMITED, f"rate limit exceeded: {what}; retry after {retry_s} s",
                        code="rate_limit_exceeded", retry_after_s=retry_s,
                        headers=dict(_header_list(dialect, decision.state, as_bytes=False)))


def _header_list(dialect: Dialect, state: QuotaState, as_bytes: bool = True) -> list:
    headers = anthropic_headers(state, time.time()) if dialect is Dialect.ANTHROPIC else openai_headers(state)
    if not as_bytes:
        return list(headers.items())
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


class QuotaSettlement:
    """Settles a reservation exactly once when the router stream ends, however it ends: prompt + generated
    tokens are kept (times the price factor), the rest refunded. A stream that produced nothing (refused by the
    router, cancelled while queued, aborted before a token) keeps nothing."""

    __slots__ = ("_gatekeeper", "_reservation", "_num_prompt_tokens", "_num_output_tokens", "_produced",
                 "_price_factor")

    def __init__(self, gatekeeper: Gatekeeper, reservation: Reservation, num_prompt_tokens: int,
                 price_factor: float = 1.0):
        self._gatekeeper = gatekeeper
        self._reservation = reservation
        self._num_prompt_tokens = num_prompt_tokens
        self._price_factor = price_factor
        self._num_output_tokens = 0
        self._produced = False

    def on_event(self, event: StreamEvent) -> None:
        if type(event) is Chunk:
            self._num_output_tokens += len(event.token_ids)
            self._produced = True
        elif type(event) is Finished and event.reason is not FinishReason.ABORT:
            self._produced = True
        elif type(event) is Withheld:
            self._num_output_tokens -= event.num_tokens
        elif type(event) is Filtered:  # stopped by the safety stage: the tokens it sent are kept
            self._num_output_tokens = event.usage.completion_tokens

    def on_end(self, error: GatewayError | None) -> None:
        used = self._num_prompt_tokens + self._num_output_tokens if self._produced else 0
        self._gatekeeper.settle_soon(self._reservation, charged_tokens(used, self._price_factor))
