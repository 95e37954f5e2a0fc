"""What the engine hands back: one RequestOutput per request that advanced in a step, and load figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.engine.request import FinishReason
from flotilla.engine.scheduler_output import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str  # complete UTF-8 text only; held-back bytes of a split character or a possible stop string
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the stop string or stop token id that matched, if any
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token, when asked for


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_queued_tokens: int  # tokens known but not yet computed, over all unfinished requests
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    prefix_hit_rate: float
    num_preemptions: int  # since start
    last_step_num_tokens: int
    last_step_seconds: float
    num_output_tokens_total: int
    num_prompt_tokens_total: int
    seq_limit: int = 0  # sequences a step may run now: the batch bound's cap, else max_num_seqs (0: unknown)
