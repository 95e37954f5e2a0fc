"""One generation stream's events as the callers of a worker see them: tokens, then exactly one end.

`StreamEvent = Chunk | Finished | Error`. rpc/convert.py decodes each GenerateResponse into one of them once
per hop (the router's relay, the gateway's router stream); whoever needs an event's content (accounting,
quotas, usage, telemetry, the answer) reads it from the decoded event instead of from the message again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.engine.request import FinishReason
from flotilla.engine.scheduler_output import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens that are ready together. `token_ids` is read-only: decoding a message does not copy it (it is
    the message's own field), so nothing may change it."""

    token_ids: Sequence[int]
    text: str  # valid UTF-8 only; bytes of a split character come with a later chunk
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when asked for


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None  # the stop string that matched
    stop_token_id: int | None = None  # the stop token id that matched (eos included)
    # The router's, on the last event: workers the request was placed on, and the resolved model version.
    num_attempts: int = 0
    model_version: str = ""


@dataclass(frozen=True, slots=True)
class Error:
    code: int  # a common.v1 ErrorCode
    message: str
    field: str = ""  # the request field at fault, if any
    retry_after_s: float = 0.0  # OVERLOADED / UNAVAILABLE: when to retry; 0 = unknown
    num_attempts: int = 0  # as on Finished
    model_version: str = ""


StreamEvent = Chunk | Finished | Error
