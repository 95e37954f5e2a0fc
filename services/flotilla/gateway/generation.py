"""What both API dialects share: checks before any engine work, the router call, its outcome.

A request is fully checked (sampling, context window) before the router sees it. The router stream is
an async generator of TokenChunk messages ending in one Outcome; closing it, or cancelling the task
that reads it, cancels the gRPC call so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, TypeVar

import grpc
from starlette.requests import Request
from starlette.types import Receive

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.request import FinishReason
from flotilla.engine.sampling_params import SamplingParams
from flotilla.gateway.auth import Principal
from flotilla.gateway.errors import ClientDisconnected, ErrorKind, GatewayError, error_from_grpc, error_from_router
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.model_registry import ServedModel
from flotilla.gateway.router_client import RouterBackend
from flotilla.gateway.telemetry import GatewayRequestTelemetry
from flotilla.observability.latency import StreamTimer

if TYPE_CHECKING:
    from flotilla.gateway.admission import RouteTicket

T = TypeVar("T")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Outcome:
    finish_reason: FinishReason  # STOP or LENGTH; an aborted generation is an error instead
    stop_sequence: str | None
    usage: Usage


@dataclass
class Generation:
    """A whole (non-streamed) answer."""

    text: str
    chunks: list[common.TokenChunk]
    outcome: Outcome


@dataclass(frozen=True)
class Job:
    """A checked request, ready for the router."""

    request_id: str
    model: ServedModel
    principal: Principal
    prompt_token_ids: list[int]
    sampling: SamplingParams
    started_at: float  # perf_counter at arrival, for TTFT
    route: RouteTicket | None = None  # class, deadline, wait budget, fair-share weight (admission.py)

    def to_proto(self, requested_model: str) -> common.GenerateRequest:
        s = self.sampling
        sampling = common.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                         top_k=s.top_k, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                                         ignore_eos=s.ignore_eos, seed=s.seed, logprobs=s.logprobs)
        request = common.GenerateRequest(request_id=self.request_id, model=requested_model,
                                         prompt_token_ids=self.prompt_token_ids, sampling=sampling,
                                         priority=common.PRIORITY_CLASS_INTERACTIVE,
                                         cache_salt=self.principal.salt, tenant_id=self.principal.tenant,
                                         key_id=self.principal.key_id)
        if self.route is not None:
            self.route.apply(request)
        return request


def checked_sampling(**kwargs) -> SamplingParams:
    """Engine sampling parameters, validated; a bad field is a 400 naming it."""
    params = SamplingParams(**kwargs)
    try:
        params.validate()
    except InvalidRequestError as err:
        raise GatewayError(ErrorKind.INVALID_REQUEST, str(err), param=err.field) from err
    return params


async def tokenize(fn: Callable[..., list[int]], *args, **kwargs) -> list[int]:
    """Runs the tokenizer off the event loop (a 4 MiB prompt takes a while); bad messages are a 400."""
    try:
        token_ids = await asyncio.to_thread(fn, *args, **kwargs)
    except InvalidRequestError as err:
        raise GatewayError(ErrorKind.INVALID_REQUEST, str(err), param=err.field) from err
    if not token_ids:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the prompt is empty", param="prompt")
    return list(token_ids)


def check_context_window(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        err = ContextLengthError(num_prompt_tokens, max_tokens, max_model_len)
        raise GatewayError(ErrorKind.INVALID_REQUEST, err.message, param=err.field, code="context_length_exceeded")


@dataclass
class Metering:
    """Latencies (TTFT, TPOT, ITL, e2e) and token counts of one request, including failed and cancelled ones."""

    metrics: GatewayMetrics
    job: Job
    num_output_tokens: int = 0
    saw_first_token: bool = field(default=False)
    timer: StreamTimer = field(init=False)

    def __post_init__(self) -> None:
        self.timer = StreamTimer(self.metrics.latency, self.job.model.name, self.job.principal.tier,
                                 self.job.started_at)

    def on_dispatch(self) -> None:
        self._tokens("prompt").inc(len(self.job.prompt_token_ids))

    def on_chunk(self, chunk: common.TokenChunk) -> None:
        self.saw_first_token = self.saw_first_token or bool(chunk.token_ids)
        self.timer.on_tokens(len(chunk.token_ids))
        self.num_output_tokens += len(chunk.token_ids)
        self._completion_tokens.inc(len(chunk.token_ids))

    @cached_property
    def _completion_tokens(self):
        return self._tokens("completion")  # the labelled counter, looked up once per request

    def _tokens(self, kind: str):
        return self.metrics.tokens.labels(self.job.model.name, self.job.principal.tier, kind)


async def router_events(backend: RouterBackend, job: Job, requested_model: str,
                        metrics: GatewayMetrics) -> AsyncIterator[common.TokenChunk | Outcome]:
    metering = Metering(metrics, job)
    metering.on_dispatch()
    telemetry = GatewayRequestTelemetry(job.request_id, job.model.name, job.principal.tier, job.principal.tenant)
    try:
        async with aclosing(backend.generate(job.to_proto(requested_model), telemetry.outgoing_metadata())) as stream:
            try:
                async for response in stream:
                    kind = response.WhichOneof("event")
                    if kind == "chunk":
                        metering.on_chunk(response.chunk)
                        yield response.chunk
                    elif kind == "finished":
                        outcome = outcome_of(response.finished, len(job.prompt_token_ids), metering.num_output_tokens)
                        telemetry.outcome = outcome.finish_reason.value
                        yield outcome
                        return
                    elif kind == "error":
                        raise error_from_router(response.error)
            except grpc.RpcError as err:
                raise error_from_grpc(err) from err
        raise GatewayError(ErrorKind.INTERNAL, "the router closed the stream without a result")
    except GatewayError as err:
        telemetry.outcome = err.code or err.kind.name.lower()
        raise
    finally:
        metering.timer.finish()
        telemetry.finish(metering.timer, len(job.prompt_token_ids))


def outcome_of(finished: common.Finished, num_prompt_tokens: int, num_output_tokens: int) -> Outcome:
    if finished.reason == common.FINISH_REASON_ABORT:
        raise GatewayError(ErrorKind.UNAVAILABLE, "the generation was aborted by the fleet; retry", code="aborted")
    reason = FinishReason.LENGTH if finished.reason == common.FINISH_REASON_LENGTH else FinishReason.STOP
    usage = Usage(prompt_tokens=finished.usage.prompt_tokens or num_prompt_tokens,
                  completion_tokens=finished.usage.completion_tokens or num_output_tokens,
                  cached_prompt_tokens=finished.usage.cached_prompt_tokens)
    return Outcome(reason, finished.stop_sequence or None, usage)


async def collect(events: AsyncIterator[common.TokenChunk | Outcome]) -> Generation:
    chunks: list[common.TokenChunk] = []
    async for event in events:
        if isinstance(event, Outcome):
            return Generation("".join(c.text for c in chunks), chunks, event)
        chunks.append(event)
    raise GatewayError(ErrorKind.INTERNAL, "the router closed the stream without a result")


async def next_event(events: AsyncIterator[T]) -> T:
    return await anext(events)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it and raise ClientDisconnected.

    Needed for everything awaited before a response starts: Starlette does not cancel a handler whose
    client went away, and the router call inside `work` must be cancelled so the engine stops.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (reading, and dropping, whatever else arrives meanwhile)."""
    while (await receive())["type"] != "http.disconnect":
        pass
