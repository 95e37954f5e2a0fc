"""Trace context (W3C traceparent) and the request's tier in gRPC metadata, both ways.

The tier rides next to the trace context rather than in GenerateRequest: it labels metrics only, and each
hop forwards it with the trace context it re-injects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from opentelemetry import propagate
from opentelemetry.context import Context

TIER_KEY = "flotilla-tier"
Metadata = list[tuple[str, str]]


class IncomingContext(NamedTuple):
    context: Context  # the caller's span as parent, or an empty context
    tier: str  # "" when the caller sent none


def outgoing_metadata(context: Context | None = None, tier: str = "") -> Metadata:
    """Metadata for a gRPC call made under `context` (default: the current one)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    if tier:
        carrier[TIER_KEY] = tier
    return list(carrier.items())


def incoming_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> IncomingContext:
    """From `ServicerContext.invocation_metadata()` (binary values and unknown keys are ignored)."""
    carrier = {key.lower(): value for key, value in (metadata or ()) if isinstance(value, str)}
    return IncomingContext(propagate.extract(carrier), carrier.get(TIER_KEY, ""))
