"""Tenant admission in the gateway: reserve quota before routing, settle (refund) after, rate-limit
headers in the dialect's style, and the request's class, deadline and wait budget for the router.

The router decides 529 (fleet overload) from the wait budget sent here; this module decides 429 (the
tenant's own quota) and 503 (Redis down while failing closed).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.gateway.auth import Principal
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.tenancy.errors import BackendUnavailable
from flotilla.tenancy.admission_policy import AdmissionPolicy
from flotilla.tenancy.gatekeeper import Gatekeeper, QuotaExceeded, Reservation
from flotilla.tenancy.headers import anthropic_headers, openai_headers
from flotilla.tenancy.quota import QuotaState, Reason

DEADLINE_HEADER = "x-flotilla-deadline-ms"
RESPONSE_HEADERS_SCOPE_KEY = "flotilla.response_headers"  # sent by RequestContextMiddleware
_PRIORITIES = {"interactive": common.PRIORITY_CLASS_INTERACTIVE, "batch": common.PRIORITY_CLASS_BATCH}
_REFUSALS = {Reason.TOKENS: "tokens per minute", Reason.REQUESTS: "requests per minute",
             Reason.CONCURRENCY: "concurrent requests"}


@dataclass(frozen=True)
class RouteTicket:
    """What the router needs to queue the request fairly and to shed it when the fleet is overloaded."""

    priority: int
    deadline_unix_s: float
    max_queue_wait_s: float
    tenant_weight: int

    def apply(self, request: common.GenerateRequest) -> None:
        request.priority = self.priority
        request.deadline_unix_s = self.deadline_unix_s
        request.max_queue_wait_s = self.max_queue_wait_s
        request.tenant_weight = self.tenant_weight


@dataclass(frozen=True)
class Admitted:
    ticket: RouteTicket
    reservation: Reservation | None
    gatekeeper: Gatekeeper | None
    num_prompt_tokens: int

    def watch(self, events: AsyncIterator) -> SettledEvents:
        return SettledEvents(events, self)


async def admit(request: Request, gatekeeper: Gatekeeper | None, policy: AdmissionPolicy, dialect: Dialect,
                principal: Principal, request_id: str, num_prompt_tokens: int, max_tokens: int) -> Admitted:
    ticket = route_ticket(request, policy, principal)
    if gatekeeper is None:
        return Admitted(ticket, None, None, num_prompt_tokens)
    try:
        reservation = await gatekeeper.reserve(principal.tenant, principal.limits, request_id,
                                               num_prompt_tokens + max_tokens)
    except QuotaExceeded as refused:
        raise _quota_error(refused, dialect, num_prompt_tokens + max_tokens) from None
    except BackendUnavailable as err:
        raise GatewayError(ErrorKind.UNAVAILABLE, "the quota store is unavailable; retry later",
                           code="unavailable") from err
    if reservation.decision is not None:
        request.scope[RESPONSE_HEADERS_SCOPE_KEY] = _header_list(dialect, reservation.decision.state)
    return Admitted(ticket, reservation, gatekeeper, num_prompt_tokens)


def route_ticket(request: Request, policy: AdmissionPolicy, principal: Principal) -> RouteTicket:
    deadline_s = _requested_deadline_s(request) or policy.deadline_s(principal.tier)
    return RouteTicket(_PRIORITIES[principal.priority_class], time.time() + deadline_s if deadline_s else 0.0,
                       policy.budget_s(principal.tier, principal.priority_class), policy.weight(principal.tier))


def _requested_deadline_s(request: Request) -> float:
    value = request.headers.get(DEADLINE_HEADER)
    if value is None:
        return 0.0
    if not value.strip().isdigit() or int(value) <= 0:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{DEADLINE_HEADER} must be a positive integer (milliseconds)",
                           param=DEADLINE_HEADER)
    return int(value) / 1000


def _quota_error(refused: QuotaExceeded, dialect: Dialect, num_tokens: int) -> GatewayError:
    decision = refused.decision
    if decision.reason == Reason.TOO_LARGE:
        limit = decision.state.limits.tokens_per_minute
        return GatewayError(ErrorKind.INVALID_REQUEST, f"prompt + max_tokens ({num_tokens}) exceeds this key's "
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


class SettledEvents:
    """The router event stream of an admitted request; closing it, or reaching its end, settles the
    reservation exactly once: prompt + generated tokens are kept, the rest refunded. A stream that
    produced nothing (refused by the router, cancelled while queued) keeps nothing."""

    def __init__(self, events: AsyncIterator, admitted: Admitted):
        self._events = events
        self._admitted = admitted
        self._num_output_tokens = 0
        self._produced = False
        self._settled = False

    def __aiter__(self) -> SettledEvents:
        return self

    async def __anext__(self):
        try:
            event = await anext(self._events)
        except BaseException:
            self._settle()
            raise
        self._produced = True
        if isinstance(event, common.TokenChunk):
            self._num_output_tokens += len(event.token_ids)
        return event

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._settle()

    def _settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        admitted = self._admitted
        if admitted.gatekeeper is not None and admitted.reservation is not None:
            used = admitted.num_prompt_tokens + self._num_output_tokens if self._produced else 0
            admitted.gatekeeper.settle_soon(admitted.reservation, used)
