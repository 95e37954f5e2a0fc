"""The router's record of one request across attempts (router/failover.py): where it was lost, and the
retryable error once no attempt is left."""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.router.failover import StreamProgress, WorkerLost


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
