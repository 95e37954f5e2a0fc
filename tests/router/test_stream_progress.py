"""The router's record of one request across attempts (router/failover.py): where it was lost, and the
retryable error once no attempt is left."""

from __future__ import annotations

import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.rpc.failover import StreamProgress, WorkerLost
from flotilla.rpc.convert import error_response, stream_event
from flotilla.rpc.stream_events import Chunk


def test_lost_attempts_name_their_workers_and_the_last_error_gives_every_reason():
    request = pb.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=8))
    progress = StreamProgress(request, max_attempts=2)
    for worker_id in ("w1", "w2"):
        progress.next_request("tiny@v1")
        progress.lost.append(WorkerLost(worker_id, "call failed: UNAVAILABLE", unreachable=True))
    assert progress.lost_worker_ids == frozenset({"w1", "w2"}) and not progress.can_retry
    error = progress.exhausted_response().error
    assert error.code == pb.ERROR_CODE_UNAVAILABLE and error.retry_after_s > 0
    assert "after 2 attempts" in error.message
    assert "worker w1: call failed: UNAVAILABLE; worker w2: call failed: UNAVAILABLE" in error.message


def test_relayed_events_count_the_tokens_and_make_the_last_one_the_callers():
    request = pb.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=8))
    progress = StreamProgress(request)
    progress.next_request("tiny@v1")
    progress.on_chunk(Chunk((10, 11), "ab"))
    progress.on_chunk(Chunk((12,), "c"))
    # A resumed attempt's worker counts the relayed tokens as prompt: the caller's usage is its own.
    response = pb.GenerateResponse(finished=pb.Finished(reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(
        prompt_tokens=5, completion_tokens=1, cached_prompt_tokens=4)))
    progress.on_result(stream_event(response), response, "w1")
    usage = response.finished.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (3, 3, 3)
    assert (response.num_attempts, response.model_version) == (1, "v1") and progress.has_result
    assert progress.delivered_token_ids == [10, 11, 12]


def test_an_error_the_worker_is_at_fault_for_loses_the_worker():
    progress = StreamProgress(pb.GenerateRequest(request_id="r1", sampling=pb.SamplingParams(max_tokens=8)))
    response = error_response(pb.ERROR_CODE_UNAVAILABLE, "draining")
    with pytest.raises(WorkerLost) as lost:
        progress.on_result(stream_event(response), response, "w1")
    assert lost.value.worker_id == "w1" and not progress.has_result
    refusal = error_response(pb.ERROR_CODE_INVALID_REQUEST, "bad top_p", "top_p")
    progress.on_result(stream_event(refusal), refusal, "w1")  # the request's fault: relayed as it is
    assert progress.has_result and refusal.error.field == "top_p"
