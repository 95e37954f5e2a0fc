"""Request state only: what the scheduler, KV cache manager and engine loop share about one request.

The one scheduling rule works on two numbers: `num_tokens` (prompt + output so far, the tokens we know)
and `num_computed_tokens` (tokens whose K/V is in the cache). Each step the scheduler hands a request
up to `num_tokens - num_computed_tokens` tokens; that covers chunked prefill, prefix hits and decode.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.engine.sampling_params import SamplingParams

# An output token sampled by a step still running on the device (engine.py, overlap_output_processing): the next
# step, scheduled meanwhile, reads its id on the device; it is filled in when the step's ids come back.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its KV was freed (recompute) or swapped out
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_tokens or context window reached
    ABORT = "abort"


class Priority(enum.IntEnum):
    """Lower value is served first and preempted last."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    cache_salt: str = ""  # tenant: prefix-cache hits never cross salts
    # Root of the request's chain of block hashes (None: none): what its K/V depend on besides its tokens, so that
    # hits never cross it (the prompt length under length-dependent RoPE, block_hash.chain_root).
    cache_root: bytes | None = None
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # A resumed stream: the last N prompt tokens are this request's own output from an earlier attempt (on
    # another worker); sampling continues at output index N.
    num_previous_output_tokens: int = 0
    # Structured outputs: the llguidance matcher following this request's output (grammar_backend.py).
    grammar: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def reached_length(self, max_model_len: int | None) -> bool:
        """Its output is as long as max_tokens allows, or its tokens fill the context window (None: no window)."""
        return (self.num_output_tokens >= self.sampling_params.max_tokens
                or (max_model_len is not None and self.num_tokens >= max_model_len))

    @property
    def awaits_token(self) -> bool:
        """Its last output token is a PLACEHOLDER: sampled by a step whose ids have not come back yet."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]
