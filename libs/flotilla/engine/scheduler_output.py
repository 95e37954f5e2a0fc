"""Typed hand-off from the scheduler to the model runner, and back. No tensors here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from flotilla.engine.request import Request


class BlockCopy(NamedTuple):
    """Copy-on-write: copy every layer's K/V of block `src` into block `dst` before the step runs."""

    src: int
    dst: int


@dataclass
class ScheduledChunk:
    """One request's share of a step: compute tokens [start, start + num_tokens) of its known tokens."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_tokens: int
    block_ids: list[int]  # the request's whole block table after allocation (covers start + num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so the step yields a new token for it."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # running requests first, then new ones
    block_copies: list[BlockCopy] = field(default_factory=list)
    # Swap preemption (optional mode): device block -> host block before the step, host -> device back.
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    # Chunks scheduled while their request's last token was a placeholder: their blocks reach the prefix cache
    # once its id is read (Scheduler.publish_filled)
    unpublished: list[ScheduledChunk] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class ModelRunnerOutput:
    """Sampled token (and optional logprobs) per request whose chunk `samples`."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, "TokenLogprobs"] = field(default_factory=dict)


@dataclass
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
