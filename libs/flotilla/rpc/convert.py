"""Conversions between the gRPC messages (flotilla.common.v1) and the Python types, both directions, in one
place: a request is a NewRequest (engine/new_request.py) on either side of the wire; a stream leaves a worker
as RequestOutputs turned into GenerateResponses, and each hop above it decodes every GenerateResponse once into
a StreamEvent (rpc/stream_events.py)."""

from __future__ import annotations

from collections.abc import Sequence

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.outputs import EngineStats, RequestOutput
from flotilla.engine.request import FinishReason, Priority
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.structured_output import StructuredOutput
from flotilla.engine.scheduler_output import TokenLogprobs
from flotilla.rpc.stream_events import Chunk, Error, Finished, StreamEvent, Usage

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
# An unspecified reason is read as STOP (what the gateway always did).
_FINISH_REASONS_FROM_PROTO = {value: reason for reason, value in _FINISH_REASONS.items()}
_PRIORITIES = {
    pb.PRIORITY_CLASS_UNSPECIFIED: Priority.INTERACTIVE,
    pb.PRIORITY_CLASS_INTERACTIVE: Priority.INTERACTIVE,
    pb.PRIORITY_CLASS_BATCH: Priority.BATCH,
}


# ---- requests --------------------------------------------------------------------------------------
def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Proto zero values mean 'not set': top_p 0 is read as 1. Validation is left to the engine."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        structured_output=(StructuredOutput(msg.structured_output.kind, msg.structured_output.spec)  # type: ignore[arg-type]
                           if msg.HasField("structured_output") else None),
    )


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.structured_output is not None:
        msg.structured_output.kind = params.structured_output.kind
        msg.structured_output.spec = params.structured_output.spec
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def priority_from_proto(value: int) -> Priority:
    if value not in _PRIORITIES:
        raise InvalidRequestError("priority", f"unknown priority class {value}")
    return _PRIORITIES[value]


def priority_to_proto(priority: Priority) -> int:
    return pb.PRIORITY_CLASS_BATCH if priority is Priority.BATCH else pb.PRIORITY_CLASS_INTERACTIVE


def new_request_from_proto(msg: pb.GenerateRequest) -> NewRequest:
    """The engine's view of a request; a resumed one's delivered tokens come apart from its prompt again.
    Raises InvalidRequestError for a priority or resume count that cannot be read; the rest is the engine's."""
    token_ids = tuple(msg.prompt_token_ids)
    num_delivered = msg.num_previous_output_tokens
    if num_delivered and num_delivered >= len(token_ids):
        raise InvalidRequestError("num_previous_output_tokens",
                                  f"must be in [0, {len(token_ids)}), got {num_delivered}")
    num_prompt = len(token_ids) - num_delivered
    return NewRequest(
        request_id=msg.request_id,
        prompt_token_ids=token_ids[:num_prompt] if num_delivered else token_ids,
        sampling_params=sampling_params_from_proto(msg.sampling),
        priority=priority_from_proto(msg.priority),
        cache_salt=msg.cache_salt,
        tenant_id=msg.tenant_id,
        deadline_unix_s=msg.deadline_unix_s,
        delivered_token_ids=token_ids[num_prompt:] if num_delivered else (),
    )


def new_request_to_proto(request: NewRequest, model: str, key_id: str = "", max_queue_wait_s: float = 0.0,
                         tenant_weight: int = 0, affinity_key: str = "") -> pb.GenerateRequest:
    """`model` and the rest are the router's alone (which version, usage ledger, admission's wait budget and
    fair share); a resumed request's delivered tokens travel at the end of the prompt (common.proto)."""
    delivered = request.delivered_token_ids
    return pb.GenerateRequest(
        request_id=request.request_id,
        model=model,
        prompt_token_ids=request.prompt_token_ids + delivered if delivered else request.prompt_token_ids,
        sampling=sampling_params_to_proto(request.sampling_params),
        priority=priority_to_proto(request.priority),
        cache_salt=request.cache_salt,
        tenant_id=request.tenant_id,
        deadline_unix_s=request.deadline_unix_s,
        num_previous_output_tokens=len(delivered),
        key_id=key_id,
        max_queue_wait_s=max_queue_wait_s,
        tenant_weight=tenant_weight,
        affinity_key=affinity_key,
    )


# ---- stream events: worker side (RequestOutput -> GenerateResponse) --------------------------------
def chunk_response(output: RequestOutput, worker_id: str = "") -> pb.GenerateResponse | None:
    """The tokens and text of one (possibly coalesced) output; None when it carries neither."""
    if not output.new_token_ids and not output.text_delta:
        return None
    response = pb.GenerateResponse()
    fill_chunk(response, output, worker_id)
    return response


def fill_chunk(response: pb.GenerateResponse, output: RequestOutput, worker_id: str = "") -> None:
    """Write chunk_response's fields into `response` (one already in its event: building it apart and copying
    it in costs a worker's event loop about a microsecond per token). The caller checked that `output`
    carries tokens or text."""
    response.worker_id = worker_id
    chunk = response.chunk
    chunk.SetInParent()
    chunk.token_ids.extend(output.new_token_ids)
    chunk.text = output.text_delta
    if output.logprobs:
        chunk.logprobs.extend(logprobs_to_proto(output.new_token_ids, output.logprobs))


def finished_response(output: RequestOutput, worker_id: str = "") -> pb.GenerateResponse:
    finished = pb.Finished(
        reason=finish_reason_to_proto(output.finish_reason),
        usage=pb.Usage(
            prompt_tokens=output.num_prompt_tokens,
            completion_tokens=output.num_output_tokens,
            cached_prompt_tokens=output.num_cached_prompt_tokens,
        ),
    )
    if isinstance(output.stop_reason, str):
        finished.stop_sequence = output.stop_reason
    elif isinstance(output.stop_reason, int):
        finished.stop_token_id = output.stop_reason
    return pb.GenerateResponse(finished=finished, worker_id=worker_id)


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_REASONS.get(reason, pb.FINISH_REASON_UNSPECIFIED) if reason is not None else 0


def logprobs_to_proto(token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=token_id,
            logprob=entry.logprob,
            top_token_ids=[t for t, _ in entry.top],
            top_logprobs=[lp for _, lp in entry.top],
        )
        for token_id, entry in zip(token_ids, logprobs)
    ]


def error_response(code: int, message: str, field: str = "", worker_id: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(error=pb.Error(code=code, message=message, field=field), worker_id=worker_id)


def invalid_request_response(exc: InvalidRequestError, worker_id: str = "") -> pb.GenerateResponse:
    code = (
        pb.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
        if isinstance(exc, ContextLengthError)
        else pb.ERROR_CODE_INVALID_REQUEST
    )
    return error_response(code, exc.message, exc.field, worker_id)


# ---- stream events: caller side (GenerateResponse -> StreamEvent, once per hop) -----------------------
def stream_event(response: pb.GenerateResponse) -> StreamEvent:
    """The event of one message. A chunk's token ids are not copied (see Chunk); a message without an event
    reads as an empty chunk, which every consumer passes over."""
    kind = response.WhichOneof("event")
    if kind == "chunk":
        chunk = response.chunk
        logprobs = chunk.logprobs
        return Chunk(chunk.token_ids, chunk.text, tuple(map(_logprobs_from_proto, logprobs)) if logprobs else ())
    if kind == "finished":
        finished = response.finished
        usage = finished.usage
        return Finished(
            reason=_FINISH_REASONS_FROM_PROTO.get(finished.reason, FinishReason.STOP),
            usage=Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens),
            stop_sequence=finished.stop_sequence or None,
            stop_token_id=finished.stop_token_id if finished.HasField("stop_token_id") else None,
            num_attempts=response.num_attempts,
            model_version=response.model_version,
        )
    if kind == "error":
        error = response.error
        return Error(error.code, error.message, error.field, error.retry_after_s, response.num_attempts,
                     response.model_version)
    return Chunk((), "")


def _logprobs_from_proto(msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.logprob, list(zip(msg.top_token_ids, msg.top_logprobs)))


# ---- load ------------------------------------------------------------------------------------------
def load_report(stats: EngineStats, active_request_ids: Sequence[str] = ()) -> pb.LoadReport:
    return pb.LoadReport(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_queued_tokens=stats.num_queued_tokens,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        block_size=stats.block_size,
        prefix_hit_rate=stats.prefix_hit_rate,
        last_step_num_tokens=stats.last_step_num_tokens,
        last_step_seconds=stats.last_step_seconds,
        num_preemptions=stats.num_preemptions,
        num_output_tokens_total=stats.num_output_tokens_total,
        num_prompt_tokens_total=stats.num_prompt_tokens_total,
        active_request_ids=sorted(active_request_ids),
    )
