"""A stand-in for LLMEngine with the same interface: one token per request per step, no model.

Token i of every request is 100 + i. Each unfinished request holds one KV block. It records the threads
that call it, so that tests can check the engine never runs on the event loop.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.outputs import EngineStats, RequestOutput
from flotilla.engine.request import FinishReason

FIRST_TOKEN = 100


@dataclass
class _FakeRequest:
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0


class FakeEngine:
    def __init__(self, num_blocks: int = 8, max_model_len: int = 1 << 30, step_seconds: float = 0.001):
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.model_version = "fake0001"
        self.step_seconds = step_seconds
        self.requests: dict[str, _FakeRequest] = {}
        self.num_steps = 0
        self.thread_ids: set[int] = set()
        self.fail_next_step = False

    def add_request(self, new: NewRequest) -> None:
        self.thread_ids.add(threading.get_ident())
        params = new.sampling_params
        params.validate()
        num_prompt_tokens = len(new.prompt_token_ids) + len(new.delivered_token_ids)
        if not new.prompt_token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ContextLengthError(num_prompt_tokens, params.max_tokens, self.max_model_len)
        if new.request_id in self.requests:
            raise InvalidRequestError("request_id", "already in use")
        self.requests[new.request_id] = _FakeRequest(num_prompt_tokens, params.max_tokens)

    def abort(self, request_id: str) -> bool:
        self.thread_ids.add(threading.get_ident())
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.fail_next_step:
            raise RuntimeError("device lost")
        time.sleep(self.step_seconds)  # a step takes time; without it an endless request would spin a core
        outputs = []
        for request_id, request in list(self.requests.items()):
            token = FIRST_TOKEN + request.num_output_tokens
            request.num_output_tokens += 1
            finished = request.num_output_tokens >= request.max_tokens
            if finished:
                del self.requests[request_id]
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[token],
                    text_delta=f"<{token}>",
                    finished=finished,
                    finish_reason=FinishReason.LENGTH if finished else None,
                    stop_reason=None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_prompt_tokens=0,
                    num_output_tokens=request.num_output_tokens,
                )
            )
        return outputs

    def stats(self) -> EngineStats:
        num_used = len(self.requests)
        return EngineStats(
            num_running=num_used, num_waiting=0, num_queued_tokens=0, num_free_blocks=self.num_blocks - num_used,
            num_total_blocks=self.num_blocks, block_size=16, prefix_hit_rate=0.0, num_preemptions=0,
            last_step_num_tokens=num_used, last_step_seconds=self.step_seconds, num_output_tokens_total=0,
            num_prompt_tokens_total=0,
        )

    def check_integrity(self) -> bool:
        return True

    def release_expired_quarantine(self) -> int:
        return 0  # holds no KV hand-offs

    def next_quarantine_release(self) -> float | None:
        return None
