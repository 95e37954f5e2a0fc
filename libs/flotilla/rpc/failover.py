"""Worker failure during a request: place it again, or resume its stream on another worker.

Whoever reads the worker's stream (the gateway on the lease path, gateway/direct_stream.py; the router on
the relay path, router/service.py) hands each token chunk to its caller as it arrives and remembers the token
ids it delivered.
When the worker goes away (a failed call: connection lost, cancelled by its shutdown; or an error event that
says the worker, not the request, is at fault), the request is placed again through admission, on the same
model version, away from the workers it was lost on (on a disaggregated pool the planner picks the decode
worker and a prefill worker for it again, disagg_planner.py):
- nothing relayed yet: the same request again (its caller cannot tell);
- tokens relayed: a resumed request, prompt + the relayed tokens with `num_previous_output_tokens` set and
  max_tokens reduced, so the new worker (or its prefill worker) prefills them, continues the sampler's seeds at
  that index and holds back the same text (see LLMEngine.add_request). The caller sees no seam, no duplicated
  or missing token.
Attempts are bounded; then the caller gets UNAVAILABLE (retryable, with retry_after_s). The terminal event
carries the number of attempts and the model version (for the usage ledger); usage counts the caller's
prompt and every relayed token, whatever worker produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.rpc.convert import error_response
from flotilla.rpc.stream_events import Chunk, Error, Finished

DEFAULT_MAX_ATTEMPTS = 3
RETRY_AFTER_S = 1.0

# Call failures that mean the worker went away (its process, its connection, or its shutdown cut the call).
LOST_STATUSES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                           grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED})
# Error events a worker sends when it cannot serve (engine dead, draining, other weights now): retry elsewhere.
LOST_ERROR_CODES = frozenset({pb.ERROR_CODE_UNAVAILABLE, pb.ERROR_CODE_INTERNAL, pb.ERROR_CODE_MODEL_NOT_FOUND,
                              pb.ERROR_CODE_LEASE_REFUSED})


class WorkerLost(Exception):
    """The worker of the current attempt failed; the request may go on elsewhere."""

    def __init__(self, worker_id: str, reason: str, unreachable: bool):
        super().__init__(f"worker {worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.unreachable = unreachable  # the connection failed: the registry should stop placing there


@dataclass
class StreamProgress:
    """One caller's request across attempts: what it asked for and which tokens it has been sent."""

    request: pb.GenerateRequest  # as the caller sent it
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    delivered_token_ids: list[int] = field(default_factory=list)
    num_attempts: int = 0
    model_version: str = ""
    lost: list[WorkerLost] = field(default_factory=list)  # how earlier attempts ended, and where
    has_result: bool = False  # a Finished or Error event was relayed

    @property
    def num_delivered(self) -> int:
        return len(self.delivered_token_ids)

    @property
    def lost_worker_ids(self) -> frozenset[str]:
        """Where earlier attempts were lost: the next one goes elsewhere while it can."""
        return frozenset(lost.worker_id for lost in self.lost)

    @property
    def can_retry(self) -> bool:
        return self.num_attempts < self.max_attempts

    @property
    def is_complete(self) -> bool:
        """Every token it may have was relayed: only the Finished event was lost."""
        return self.num_delivered >= self.request.sampling.max_tokens > 0

    def next_request(self, qualified_model: str) -> pb.GenerateRequest:
        """The request for the next attempt (counted), on exactly this model version."""
        self.num_attempts += 1
        self.model_version = qualified_model.partition("@")[2]
        return self.placement_request(qualified_model)

    def placement_request(self, model: str) -> pb.GenerateRequest:
        """The request as the next attempt would send it (not counted): prompt + delivered tokens, the rest of
        max_tokens, away from the workers it was lost on. What a lease is acquired with."""
        attempt = pb.GenerateRequest()
        attempt.CopyFrom(self.request)
        attempt.model = model
        attempt.avoid_worker_ids[:] = sorted(self.lost_worker_ids)
        if self.delivered_token_ids:
            attempt.prompt_token_ids.extend(self.delivered_token_ids)
            attempt.num_previous_output_tokens = self.request.num_previous_output_tokens + self.num_delivered
            attempt.sampling.max_tokens = self.request.sampling.max_tokens - self.num_delivered
        return attempt

    def on_chunk(self, chunk: Chunk) -> None:
        self.delivered_token_ids.extend(chunk.token_ids)

    def on_result(self, event: Finished | Error, response: pb.GenerateResponse, worker_id: str) -> None:
        """A worker's last event (decoded: `event`, its message: `response`), made the caller's: its usage and
        stamps set on `response`, which is relayed as it is. Raises WorkerLost for an error the worker, not the
        request, is at fault for."""
        if type(event) is Error:
            if event.code in LOST_ERROR_CODES:
                raise WorkerLost(worker_id, f"{pb.ErrorCode.Name(event.code)}: {event.message}", unreachable=False)
        else:
            self._fix_usage(response.finished.usage)
        self._stamp(response)
        self.has_result = True

    def on_call_error(self, exc: grpc.aio.AioRpcError, worker_id: str) -> None:
        """Raises WorkerLost when the call failed because the worker went away; returns otherwise."""
        if exc.code() in LOST_STATUSES:
            raise WorkerLost(worker_id, f"call failed: {exc.code().name} {exc.details() or ''}".strip(),
                             unreachable=exc.code() == grpc.StatusCode.UNAVAILABLE)

    def ended_without_result(self, worker_id: str) -> WorkerLost:
        return WorkerLost(worker_id, "stream ended without a result", unreachable=False)

    def finished_response(self) -> pb.GenerateResponse:
        """A lost worker had sent every token but not its Finished event: finish here (max_tokens reached)."""
        response = pb.GenerateResponse(finished=pb.Finished(reason=pb.FINISH_REASON_LENGTH))
        self._fix_usage(response.finished.usage)
        self._stamp(response)
        return response

    def exhausted_response(self) -> pb.GenerateResponse:
        reasons = "; ".join(str(lost) for lost in self.lost[-self.max_attempts:])
        response = error_response(pb.ERROR_CODE_UNAVAILABLE,
                                  f"no worker could finish the request after {self.num_attempts} attempts ({reasons}); "
                                  "retry")
        response.error.retry_after_s = RETRY_AFTER_S
        self._stamp(response)
        return response

    def stamp(self, response: pb.GenerateResponse) -> pb.GenerateResponse:
        """Attempts and model version on a terminal event the router makes itself (a refusal)."""
        self._stamp(response)
        return response

    def _stamp(self, response: pb.GenerateResponse) -> None:
        response.num_attempts = self.num_attempts
        response.model_version = self.model_version

    def _fix_usage(self, usage: pb.Usage) -> None:
        # A resumed attempt counts the relayed tokens as its prompt: the caller's usage is its own prompt
        # and every token it was sent, whichever worker made it.
        num_prompt = len(self.request.prompt_token_ids)
        usage.cached_prompt_tokens = min(usage.cached_prompt_tokens, num_prompt)
        usage.prompt_tokens = num_prompt
        usage.completion_tokens = self.num_delivered
