"""Proto <-> engine conversions."""

from __future__ import annotations

import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.outputs import EngineStats, RequestOutput
from flotilla.engine.request import FinishReason, Priority
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.structured_output import StructuredOutput
from flotilla.engine.scheduler_output import TokenLogprobs
from flotilla.rpc.convert import (
    chunk_response,
    error_response,
    finished_response,
    invalid_request_response,
    load_report,
    new_request_from_proto,
    new_request_to_proto,
    priority_from_proto,
    sampling_params_from_proto,
    stream_event,
)
from flotilla.rpc.stream_events import Chunk, Error, Finished, Usage


def output(**overrides) -> RequestOutput:
    fields = dict(
        request_id="r", new_token_ids=[5, 6], text_delta="hi", finished=False, finish_reason=None,
        stop_reason=None, num_prompt_tokens=3, num_cached_prompt_tokens=1, num_output_tokens=2,
    )
    return RequestOutput(**{**fields, **overrides})


PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.5, top_k=3, seed=11, stop=("x",),
                        stop_token_ids=(2,), ignore_eos=True, logprobs=0,
                        structured_output=StructuredOutput("regex", "[a-z]+"))


def test_new_request_round_trip():
    request = NewRequest("r", (1, 2), PARAMS, Priority.BATCH, "salt", "tenant", 12.5)
    msg = new_request_to_proto(request, "tiny", key_id="k1", max_queue_wait_s=2.0, tenant_weight=3)
    assert new_request_from_proto(msg) == request
    assert sampling_params_from_proto(msg.sampling) == PARAMS
    assert priority_from_proto(msg.priority) is Priority.BATCH
    assert (msg.model, msg.cache_salt, msg.tenant_id, msg.deadline_unix_s) == ("tiny", "salt", "tenant", 12.5)
    assert (msg.key_id, msg.max_queue_wait_s, msg.tenant_weight) == ("k1", 2.0, 3)


def test_a_resumed_request_carries_its_delivered_tokens_at_the_end_of_the_prompt():
    request = NewRequest("r", (1, 2, 3), PARAMS, delivered_token_ids=(7, 8))
    msg = new_request_to_proto(request, "tiny@v1")
    assert list(msg.prompt_token_ids) == [1, 2, 3, 7, 8] and msg.num_previous_output_tokens == 2
    back = new_request_from_proto(msg)
    assert (back.prompt_token_ids, back.delivered_token_ids) == ((1, 2, 3), (7, 8))
    assert new_request_from_proto(new_request_to_proto(NewRequest("r", (1,), PARAMS), "tiny")).delivered_token_ids == ()


def test_a_resume_count_beyond_the_prompt_is_refused():
    msg = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], num_previous_output_tokens=3,
                             sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError) as err:
        new_request_from_proto(msg)
    assert err.value.field == "num_previous_output_tokens"


def test_proto_zero_values_mean_unset():
    params = sampling_params_from_proto(pb.SamplingParams(max_tokens=4))
    assert params.structured_output is None
    assert params.top_p == 1.0 and params.seed is None and params.logprobs is None and params.temperature == 0.0
    assert priority_from_proto(pb.PRIORITY_CLASS_UNSPECIFIED) is Priority.INTERACTIVE


def test_chunk_carries_tokens_text_and_logprobs():
    lp = [TokenLogprobs(-0.5, [(5, -0.5), (9, -1.0)]), TokenLogprobs(-0.1)]
    response = chunk_response(output(logprobs=lp), "w1")
    assert list(response.chunk.token_ids) == [5, 6] and response.chunk.text == "hi"
    assert response.worker_id == "w1"
    assert [entry.token_id for entry in response.chunk.logprobs] == [5, 6]
    assert list(response.chunk.logprobs[0].top_token_ids) == [5, 9]
    assert chunk_response(output(new_token_ids=[], text_delta="")) is None


def test_finished_with_stop_string_or_token():
    by_string = finished_response(output(finished=True, finish_reason=FinishReason.STOP, stop_reason="END"))
    assert by_string.finished.reason == pb.FINISH_REASON_STOP
    assert by_string.finished.stop_sequence == "END" and not by_string.finished.HasField("stop_token_id")
    by_token = finished_response(output(finished=True, finish_reason=FinishReason.STOP, stop_reason=0))
    assert by_token.finished.HasField("stop_token_id") and by_token.finished.stop_token_id == 0
    usage = by_token.finished.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (3, 2, 1)
    aborted = finished_response(output(finished=True, finish_reason=FinishReason.ABORT))
    assert aborted.finished.reason == pb.FINISH_REASON_ABORT


def test_error_codes():
    assert invalid_request_response(InvalidRequestError("top_p", "bad")).error.code == pb.ERROR_CODE_INVALID_REQUEST
    response = invalid_request_response(ContextLengthError(100, 50, 120))
    assert response.error.code == pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
    assert response.error.field == "max_tokens"


def test_load_report():
    stats = EngineStats(1, 2, 30, 40, 64, 16, 0.5, 3, 8, 0.01, 100, 200)
    report = load_report(stats, ["b", "a"])
    assert (report.num_running, report.num_waiting, report.num_queued_tokens) == (1, 2, 30)
    assert (report.num_free_blocks, report.num_total_blocks, report.block_size) == (40, 64, 16)
    assert list(report.active_request_ids) == ["a", "b"]


def test_each_message_decodes_once_into_its_stream_event():
    lp = [TokenLogprobs(-0.5, [(5, -0.5), (9, -1.0)]), TokenLogprobs(-0.25)]
    chunk = stream_event(chunk_response(output(logprobs=lp), "w1"))
    assert type(chunk) is Chunk and list(chunk.token_ids) == [5, 6] and chunk.text == "hi"
    assert chunk.logprobs == tuple(lp)
    assert stream_event(chunk_response(output())).logprobs == ()
    response = finished_response(output(finished=True, finish_reason=FinishReason.LENGTH, stop_reason=0))
    response.num_attempts, response.model_version = 2, "v1"
    assert stream_event(response) == Finished(FinishReason.LENGTH, Usage(3, 2, 1), None, 0, 2, "v1")
    by_string = finished_response(output(finished=True, finish_reason=FinishReason.STOP, stop_reason="END"))
    assert stream_event(by_string).stop_sequence == "END" and stream_event(by_string).stop_token_id is None
    refusal = error_response(pb.ERROR_CODE_OVERLOADED, "queue full", "model")
    refusal.error.retry_after_s = 1.5
    assert stream_event(refusal) == Error(pb.ERROR_CODE_OVERLOADED, "queue full", "model", 1.5)
    assert stream_event(pb.GenerateResponse()) == Chunk((), "")  # no event: nothing to pass on
