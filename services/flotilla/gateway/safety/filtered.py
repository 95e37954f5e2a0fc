"""Filtered: how an answer blocked by the output screen ends, in place of the router's Finished event; Withheld:
what the router stream's taps are told of tokens still held back when it ends otherwise."""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.safety.verdict import Verdict
from flotilla.rpc.stream_events import Usage

CONTENT_FILTER_CODE = "content_filter"


@dataclass(frozen=True, slots=True)
class Filtered:
    verdict: Verdict
    usage: Usage  # completion_tokens: the tokens delivered before the block (what is billed)
    stop_sequence: None = None  # read like a Finished event's by the answer builders

    def error(self) -> GatewayError:
        """For a dialect that ends a blocked stream with an error event (Anthropic)."""
        return blocked_error("the answer", self.verdict)


@dataclass(frozen=True, slots=True)
class Withheld:
    """Told to every tap just before the end: tokens the router relayed that the client never got (held back by
    the safety stage when the client went away or the router failed), so usage and quota do not bill them."""

    num_tokens: int


def blocked_error(what: str, verdict: Verdict) -> GatewayError:
    if verdict.unavailable:
        return GatewayError(ErrorKind.UNAVAILABLE, "the safety classifier is unavailable; retry later",
                            code="safety_unavailable")
    return GatewayError(ErrorKind.INVALID_REQUEST, f"{what} was blocked by the safety policy (category: "
                        f"{verdict.category})", code=CONTENT_FILTER_CODE)
