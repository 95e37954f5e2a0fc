"""The lease path: the router places, the gateway streams from the worker (router/lease_service.py).

A request's stream (DirectStream) acquires a lease on the router's AcquireSession (queueing, fairness and the
529 estimate happen there), opens the stream on the leased worker's generate session (one per gateway and
worker, WorkerSessions), and hands the worker's events on, decoded once each, consecutive chunks that have
already arrived merged into one. When the stream ends (its last event, an error, or its reader closing it)
the lease is closed with a StreamReport: the router's accounting of the request comes from that, not from
the tokens.

Failover is here, where the delivered tokens are (rpc/failover.py): a lost worker (a failed call, a stream
cut off without its last event, an error event that says the worker is at fault, a refused lease) closes
the lease as lost and acquires a new one away from the workers the request was lost on, for prompt + the
delivered tokens; the new worker continues the sampler's seeds, so the caller sees no seam. Attempts are
bounded, then the caller gets UNAVAILABLE with a retry_after_s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.rpc.convert import error_response, stream_event
from flotilla.rpc.failover import DEFAULT_MAX_ATTEMPTS, StreamProgress, WorkerLost
from flotilla.rpc.options import aio_channel
from flotilla.rpc.session_client import SessionClient, SessionStream
from flotilla.rpc.stream_events import Chunk, Error, StreamEvent
from flotilla.rpc.tls import InternalTLS

logger = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]
# Opens an Acquire stream on the router (the seam where the choice of router goes: RouterClient.acquire).
AcquireCall = Callable[[common.GenerateRequest, Metadata], SessionStream]


def merge_chunk(into: common.TokenChunk, following: common.TokenChunk) -> None:
    into.token_ids.extend(following.token_ids)
    into.text += following.text
    into.logprobs.extend(following.logprobs)


def next_merged(call: SessionStream, response: common.GenerateResponse
                ) -> tuple[common.GenerateResponse, common.GenerateResponse | None]:
    """`response` with the chunks that already arrived behind it merged in, and a non-chunk response read
    while merging (to be handed out next): a reader that falls behind sends several tokens per event instead
    of working through a backlog one token at a time."""
    following = call.next_ready()
    if following is not None and response.HasField("chunk"):
        while following is not None and following.HasField("chunk"):
            merge_chunk(response.chunk, following.chunk)
            following = call.next_ready()
    return response, following


class WorkerSessions:
    """One generate session per worker address this gateway streams from, over the gateway's identity."""

    def __init__(self, tls: InternalTLS | None):
        self._tls = tls
        self._sessions: dict[str, tuple[grpc.aio.Channel, SessionClient]] = {}

    def session(self, address: str) -> SessionClient:
        entry = self._sessions.get(address)
        if entry is None:
            channel = aio_channel(address, self._tls, "worker")
            entry = self._sessions[address] = (channel, SessionClient(_worker_session_opener(channel)))
        return entry[1]

    async def close(self) -> None:
        for channel, session in self._sessions.values():
            session.close()
            await channel.close()
        self._sessions.clear()


def _worker_session_opener(channel: grpc.aio.Channel):
    from flotilla.api.worker.v1 import worker_pb2_grpc

    return worker_pb2_grpc.WorkerServiceStub(channel).GenerateSession


class DirectStream:
    """One request's events, streamed from leased workers; `aclose()` cancels the worker stream and releases
    the lease (a cancelled request is aborted in its engine)."""

    def __init__(self, acquire: AcquireCall, workers: WorkerSessions, request: common.GenerateRequest,
                 metadata: Metadata = (), max_attempts: int = DEFAULT_MAX_ATTEMPTS):
        self._acquire = acquire
        self._workers = workers
        self._metadata = tuple(metadata)
        self._progress = StreamProgress(request, max_attempts)
        self._model = request.model  # what is asked for; the resolved name@version once a lease says
        self._lease_call: SessionStream | None = None
        self._call: SessionStream | None = None
        self._worker_id = ""
        self._held: common.GenerateResponse | None = None
        self._done = False
        self._started = time.monotonic()
        self._lease_tokens = 0  # delivered under the current lease
        self._first_token_at: float | None = None  # of the current lease, when its tokens are the first ones
        self._last_token_at = 0.0

    def __aiter__(self) -> DirectStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        while True:
            if self._call is None:
                refusal = await self._place()
                if refusal is not None:
                    return self._last(refusal, common.StreamReport(error_code=refusal.error.code))
            try:
                response, self._held = self._held, None
                if response is None:
                    response = await self._call.__anext__()
                response, self._held = next_merged(self._call, response)
                event = stream_event(response)
                if type(event) is Chunk:
                    self._on_chunk(event)
                    return event
                self._progress.on_result(event, response, self._worker_id)  # raises WorkerLost
                return self._last(response, self._report(event))
            except StopAsyncIteration:
                lost = self._progress.ended_without_result(self._worker_id)
            except WorkerLost as exc:
                lost = exc
            except grpc.aio.AioRpcError as exc:
                try:
                    self._progress.on_call_error(exc, self._worker_id)
                except WorkerLost as exc_lost:
                    lost = exc_lost
                else:
                    error = self._progress.stamp(_worker_error(self._worker_id, exc))
                    return self._last(error, common.StreamReport(error_code=error.error.code))
            terminal = self._after_loss(lost)
            if terminal is not None:
                report = common.StreamReport(error_code=terminal.error.code) if terminal.HasField("error") else None
                return self._last(terminal, report)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._end_attempt(self._report(None))  # cancelled

    # ---- placement ---------------------------------------------------------------------------------
    async def _place(self) -> common.GenerateResponse | None:
        """A lease and the worker stream under it; the refusal to hand out instead when none was granted."""
        progress = self._progress
        call = self._lease_call = self._acquire(progress.placement_request(self._model), self._metadata)
        try:
            answer = await call.__anext__()
        except StopAsyncIteration:
            answer = error_response(common.ERROR_CODE_INTERNAL, "the router ended an Acquire without an answer")
        except grpc.aio.AioRpcError:
            self._lease_call = None
            if not progress.num_attempts:
                raise  # the router is unreachable: the caller maps it (503)
            answer = error_response(common.ERROR_CODE_UNAVAILABLE, "the router is unreachable")
        if not answer.HasField("lease"):
            call.cancel()
            self._lease_call = None
            return self._refused(answer)
        lease = answer.lease
        self._model = lease.model
        attempt = progress.next_request(lease.model)
        attempt.ClearField("avoid_worker_ids")
        attempt.prefill_worker_address = lease.prefill_worker_address
        attempt.lease.CopyFrom(lease)
        self._worker_id = lease.worker_id
        self._lease_tokens = 0
        self._call = self._workers.session(lease.worker_address).generate(
            attempt, self._metadata, timeout=_timeout(progress.request.deadline_unix_s))
        return None

    def _refused(self, answer: common.GenerateResponse) -> common.GenerateResponse:
        progress = self._progress
        if not progress.lost:
            return answer  # the first placement: the router's answer as it is (a 529, a 404, ...)
        # Its version may be gone with its last worker: still "retry later" for the caller, not a 404.
        error = answer.error
        code = common.ERROR_CODE_UNAVAILABLE if error.code == common.ERROR_CODE_MODEL_NOT_FOUND else error.code
        refusal = error_response(code, f"worker lost ({progress.lost[-1].reason}) and none took the request over: "
                                       f"{error.message}; retry")
        refusal.error.retry_after_s = error.retry_after_s or 1.0
        return progress.stamp(refusal)

    def _after_loss(self, lost: WorkerLost) -> common.GenerateResponse | None:
        """Ends the lost attempt; the last event to hand out when the request cannot go on, else None."""
        progress = self._progress
        report = self._report(None, worker_lost=True)
        report.worker_unreachable = lost.unreachable
        self._end_attempt(report)
        progress.lost.append(lost)
        logger.warning("request %s lost %s after %d tokens (attempt %d of %d)", progress.request.request_id, lost,
                       progress.num_delivered, progress.num_attempts, progress.max_attempts)
        if progress.is_complete:
            return progress.finished_response()
        if not progress.can_retry:
            return progress.exhausted_response()
        return None

    # ---- accounting --------------------------------------------------------------------------------
    def _on_chunk(self, chunk: Chunk) -> None:
        num_tokens = len(chunk.token_ids)
        if not num_tokens:
            return
        now = time.monotonic()
        if self._first_token_at is None and not self._progress.num_delivered:
            self._first_token_at = now
        self._last_token_at = now
        self._lease_tokens += num_tokens
        self._progress.on_chunk(chunk)

    def _report(self, event: StreamEvent | None, worker_lost: bool = False) -> common.StreamReport:
        report = common.StreamReport(finished=event is not None and type(event) is not Error,
                                     worker_lost=worker_lost, num_output_tokens=self._lease_tokens)
        if type(event) is Error:
            report.error_code = event.code
        first = self._first_token_at
        if first is not None:
            report.ttft_s = first - self._started
            if self._lease_tokens > 1:
                report.tpot_s = (self._last_token_at - first) / (self._lease_tokens - 1)
        return report

    def _last(self, response: common.GenerateResponse, report: common.StreamReport | None) -> StreamEvent:
        self._done = True
        self._end_attempt(report or self._report(None))
        return stream_event(response)

    def _end_attempt(self, report: common.StreamReport) -> None:
        """Cancels the worker stream (a no-op once it ended) and closes the lease with `report`."""
        call, self._call = self._call, None
        self._held = None
        if call is not None:
            call.cancel()
        lease_call, self._lease_call = self._lease_call, None
        if lease_call is not None:
            lease_call.cancel(report)
        self._first_token_at = None


def _worker_error(worker_id: str, exc: grpc.aio.AioRpcError) -> common.GenerateResponse:
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return error_response(common.ERROR_CODE_DEADLINE_EXCEEDED, "deadline exceeded", worker_id=worker_id)
    logger.warning("worker %s failed a Generate call: %s %s", worker_id, exc.code(), exc.details())
    return error_response(common.ERROR_CODE_INTERNAL, f"worker error: {exc.code().name}", worker_id=worker_id)


def _timeout(deadline_unix_s: float) -> float | None:
    if deadline_unix_s <= 0:
        return None
    return max(0.001, deadline_unix_s - time.time())
