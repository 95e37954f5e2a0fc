"""The gateway's lease path (gateway/direct_stream.py) against scripted router and worker streams: a lost worker's
stream resumes under a new lease for prompt + delivered tokens away from it, attempts are bounded, a refusal
after a loss is retryable, and every lease is closed with the gateway's report of what it delivered."""

from __future__ import annotations

import collections

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.gateway.direct_stream import DirectStream
from flotilla.rpc.session_client import rpc_error
from flotilla.rpc.stream_events import Chunk, Error, Finished

pytestmark = pytest.mark.unit


class ScriptedStream:
    """A SessionStream whose responses (or a final exception) are given up front."""

    def __init__(self, items: list) -> None:
        self._items = collections.deque(items)
        self.cancelled_with: list[pb.StreamReport | None] = []

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def next_ready(self):
        return None

    def cancel(self, report: pb.StreamReport | None = None) -> bool:
        self.cancelled_with.append(report)
        return True


class Fleet:
    """Leases from a script of worker ids; each worker's streams from a script of responses per attempt."""

    def __init__(self, leases: list[str | pb.GenerateResponse], workers: dict[str, list[list]]):
        self._leases = collections.deque(leases)
        self._workers = {w: collections.deque(attempts) for w, attempts in workers.items()}
        self.acquired: list[pb.GenerateRequest] = []
        self.opened: list[pb.GenerateRequest] = []
        self.lease_streams: list[ScriptedStream] = []

    def acquire(self, request: pb.GenerateRequest, metadata) -> ScriptedStream:
        self.acquired.append(request)
        answer = self._leases.popleft()
        if isinstance(answer, str):
            answer = pb.GenerateResponse(lease=pb.Lease(lease_id=f"l{len(self.acquired)}", worker_id=answer,
                                                        worker_address=answer, model="m@v1", token="t"))
        stream = ScriptedStream([answer])
        self.lease_streams.append(stream)
        return stream

    def session(self, address: str):
        return self

    def generate(self, request: pb.GenerateRequest, metadata, timeout=None) -> ScriptedStream:
        self.opened.append(request)
        return ScriptedStream(self._workers[request.lease.worker_id].popleft())


def chunk(*token_ids: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=token_ids, text="x" * len(token_ids)))


FINISHED = pb.GenerateResponse(finished=pb.Finished(reason=pb.FINISH_REASON_LENGTH,
                                                    usage=pb.Usage(prompt_tokens=5, completion_tokens=2)))
LOST = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")


def request(max_tokens: int = 4) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3],
                              sampling=pb.SamplingParams(max_tokens=max_tokens))


async def drain(stream: DirectStream) -> list:
    events = [event async for event in stream]
    await stream.aclose()
    return events


async def test_a_lost_worker_resumes_under_a_new_lease_for_prompt_plus_delivered_tokens():
    fleet = Fleet(["w0", "w1"], {"w0": [[chunk(7), chunk(8), LOST]], "w1": [[chunk(9), chunk(10), FINISHED]]})
    events = await drain(DirectStream(fleet.acquire, fleet, request()))
    assert [tuple(e.token_ids) for e in events[:-1]] == [(7,), (8,), (9,), (10,)]
    finished = events[-1]
    assert type(finished) is Finished and finished.num_attempts == 2 and finished.model_version == "v1"
    assert (finished.usage.prompt_tokens, finished.usage.completion_tokens) == (3, 4)  # the caller's, not w1's
    retry = fleet.acquired[1]
    assert list(retry.prompt_token_ids) == [1, 2, 3, 7, 8] and retry.num_previous_output_tokens == 2
    assert retry.sampling.max_tokens == 2 and list(retry.avoid_worker_ids) == ["w0"] and retry.model == "m@v1"
    resumed = fleet.opened[1]
    assert resumed.lease.worker_id == "w1" and not resumed.avoid_worker_ids
    (lost_report,), (done_report,) = (s.cancelled_with for s in fleet.lease_streams)
    assert lost_report.worker_lost and lost_report.worker_unreachable and lost_report.num_output_tokens == 2
    assert lost_report.ttft_s > 0  # the request's first token came under this lease
    assert done_report.finished and done_report.num_output_tokens == 2 and done_report.ttft_s == 0


async def test_attempts_are_bounded_then_a_retryable_error():
    fleet = Fleet(["w0", "w1", "w2"], {w: [[chunk(1), LOST]] for w in ("w0", "w1", "w2")})
    events = await drain(DirectStream(fleet.acquire, fleet, request(max_tokens=10), max_attempts=3))
    error = events[-1]
    assert type(error) is Error and error.code == pb.ERROR_CODE_UNAVAILABLE and error.retry_after_s > 0
    assert error.num_attempts == 3 and "after 3 attempts" in error.message
    assert [list(r.avoid_worker_ids) for r in fleet.acquired] == [[], ["w0"], ["w0", "w1"]]


async def test_a_refusal_after_a_loss_is_retryable_and_a_first_refusal_is_passed_on_as_it_is():
    gone = pb.GenerateResponse(error=pb.Error(code=pb.ERROR_CODE_MODEL_NOT_FOUND, message="no such version"))
    fleet = Fleet(["w0", gone], {"w0": [[chunk(1), LOST]]})
    events = await drain(DirectStream(fleet.acquire, fleet, request()))
    assert events[-1].code == pb.ERROR_CODE_UNAVAILABLE and "worker lost" in events[-1].message
    overloaded = pb.GenerateResponse(error=pb.Error(code=pb.ERROR_CODE_OVERLOADED, message="busy", retry_after_s=3))
    (event,) = await drain(DirectStream(Fleet([overloaded], {}).acquire, fleet, request()))
    assert (event.code, event.retry_after_s, event.num_attempts) == (pb.ERROR_CODE_OVERLOADED, 3, 0)


async def test_a_refused_lease_is_retried_elsewhere_and_closing_early_reports_a_cancel():
    refused = pb.GenerateResponse(error=pb.Error(code=pb.ERROR_CODE_LEASE_REFUSED, message="expired"))
    fleet = Fleet(["w0", "w1"], {"w0": [[refused]], "w1": [[chunk(5), chunk(6), FINISHED]]})
    stream = DirectStream(fleet.acquire, fleet, request())
    assert type(await stream.__anext__()) is Chunk
    await stream.aclose()  # the client went away
    (refused_report,), (cancel_report,) = (s.cancelled_with for s in fleet.lease_streams)
    assert refused_report.worker_lost and not refused_report.worker_unreachable
    assert not cancel_report.finished and not cancel_report.error_code and cancel_report.num_output_tokens == 1
