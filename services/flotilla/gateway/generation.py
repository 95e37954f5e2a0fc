"""What both API dialects share: checks before any engine work, the router call, its outcome.

A request is fully checked (sampling, context window) before the router sees it. Its router stream is read in
one loop (RouterEvents): each event, decoded once (rpc/convert.py), goes to every tap (the usage meter and
telemetry here, quota settlement (admission.py), the usage ledger (usage_meter.py)), then out as a Chunk, and
last the Finished event; an error ends it as a GatewayError. Closing it, or cancelling the task that reads it,
cancels the router call so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
from starlette.requests import Request
from starlette.types import Receive

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.request import FinishReason
from flotilla.engine.sampling_params import SamplingParams
from flotilla.gateway.auth import Principal
from flotilla.gateway.errors import ClientDisconnected, ErrorKind, GatewayError, error_from_grpc, error_from_router
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.model_registry import ServedModel
from flotilla.gateway.safety.filtered import Withheld
from flotilla.gateway.telemetry import GatewayRequestTelemetry
from flotilla.gateway.usage_meter import UsageLedgerTap
from flotilla.observability.latency import StreamTimer
from flotilla.rpc.convert import new_request_to_proto
from flotilla.rpc.stream_events import Chunk, Finished, StreamEvent, Usage

if TYPE_CHECKING:
    from flotilla.gateway.admission import Admitted, RouteTicket
    from flotilla.gateway.context import GatewayContext

T = TypeVar("T")
Events = AsyncIterator[Chunk | Finished]  # what a dialect reads: chunks, then the Finished event


@dataclass
class Generation:
    """A whole (non-streamed) answer."""

    text: str
    chunks: list[Chunk]
    finished: Finished  # or the safety stage's Filtered (safety/filtered.py)


@dataclass(frozen=True)
class Job:
    """A checked request, ready for the router."""

    request: NewRequest
    model: ServedModel
    principal: Principal
    started_at: float  # perf_counter at arrival, for TTFT
    route: RouteTicket  # class, deadline, wait budget, fair-share weight (admission.py)
    affinity_key: str = ""  # the conversation, for a rollout's sticky split (conversation_key.py)

    @classmethod
    def create(cls, request_id: str, model: ServedModel, principal: Principal, prompt_token_ids: list[int],
               sampling: SamplingParams, started_at: float, route: RouteTicket, affinity_key: str = "") -> Job:
        if route.max_tokens_cap:  # degraded under load (degradation.py)
            sampling = replace(sampling, max_tokens=min(sampling.max_tokens, route.max_tokens_cap))
        request = NewRequest(request_id, tuple(prompt_token_ids), sampling, route.priority, principal.salt,
                             principal.tenant, route.deadline_unix_s)
        return cls(request, model, principal, started_at, route, affinity_key)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    def to_proto(self, requested_model: str) -> common.GenerateRequest:
        return new_request_to_proto(self.request, requested_model, key_id=self.principal.key_id,
                                    max_queue_wait_s=self.route.max_queue_wait_s,
                                    tenant_weight=self.route.tenant_weight, affinity_key=self.affinity_key)


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


class StreamTap(Protocol):
    """One concern's view of a router stream: every decoded event in order, then its end, exactly once."""

    def on_event(self, event: StreamEvent) -> None: ...

    def on_end(self, error: GatewayError | None) -> None:
        """`error`: what ended the stream (its __cause__ the gRPC error of a failed call); None when it
        finished, or when it was closed (the client went away) before."""


@dataclass
class Metering:
    """Latencies (TTFT, TPOT, ITL, e2e) and token counts of one request, including failed and cancelled ones."""

    metrics: GatewayMetrics
    job: Job
    timer: StreamTimer = field(init=False)

    def __post_init__(self) -> None:
        self.timer = StreamTimer(self.metrics.latency, self.job.model.name, self.job.principal.tier,
                                 self.job.started_at)
        self._tokens("prompt").inc(self.job.num_prompt_tokens)

    def on_event(self, event: StreamEvent) -> None:
        if type(event) is Chunk and (num_tokens := len(event.token_ids)):
            self.timer.on_tokens(num_tokens)
            self._completion_tokens.inc(num_tokens)

    def on_end(self, error: GatewayError | None) -> None:
        self.timer.finish()

    @cached_property
    def _completion_tokens(self):
        return self._tokens("completion")  # the labelled counter, looked up once per request

    def _tokens(self, kind: str):
        return self.metrics.tokens.labels(self.job.model.name, self.job.principal.tier, kind)


def router_events(ctx: GatewayContext, job: Job, requested_model: str, admitted: Admitted,
                  streamed: bool = False) -> RouterEvents:
    """streamed: the handler sends tokens as they come (what a usage checkpoint may bill: usage_meter.py)."""
    return RouterEvents(ctx, job, requested_model, admitted.settlement(), streamed)


class RouterEvents:
    """The one loop over a request's router stream (see the module's docstring). The router call and every tap
    but quota settlement start with the first read; the stream ends with an error, with the read after the
    Finished event, or when it is closed (read or not): then every tap ends, exactly once, and an unfinished
    call is cancelled."""

    def __init__(self, ctx: GatewayContext, job: Job, requested_model: str, settlement: StreamTap | None,
                 streamed: bool = False):
        self._ctx = ctx
        self._streamed = streamed
        self._job = job
        self._requested_model = requested_model
        self._taps: list[StreamTap] = [settlement] if settlement is not None else []
        self._on_event: tuple[Callable[[StreamEvent], None], ...] = ()
        self._call: AsyncIterator[StreamEvent] | None = None  # the router call, once started
        self._reading: AsyncIterator[StreamEvent] | None = None  # the call, until its last event was read
        self._metering: Metering | None = None
        self._ledger_tap: UsageLedgerTap | None = None
        self._ended = False
        self.num_withheld_tokens = 0  # kept up to date by whoever holds tokens back (safety/stage.py)

    def __aiter__(self) -> RouterEvents:
        return self

    async def __anext__(self) -> Chunk | Finished:
        stream = self._reading
        if stream is None:
            if self._call is not None or self._ended:
                await self.aclose()
                raise StopAsyncIteration
            stream = self._start()
        try:
            event = await stream.__anext__()
        except StopAsyncIteration:
            raise await self._fail(GatewayError(ErrorKind.INTERNAL, "the router closed the stream without a result"))
        except grpc.RpcError as err:
            raise await self._fail(error_from_grpc(err, self._job.request_id), cause=err) from err
        except BaseException:  # cancelled: the client went away
            await self.aclose()
            raise
        for on_event in self._on_event:
            on_event(event)
        if type(event) is Chunk:
            return event
        if type(event) is Finished:
            if event.reason is FinishReason.ABORT:
                raise await self._fail(GatewayError(ErrorKind.UNAVAILABLE,
                                                    "the generation was aborted by the fleet; retry", code="aborted"))
            self._reading = None
            if self._ledger_tap is not None:
                await self._ledger_tap.settle()  # billed before the handler sends its last byte
            return self._with_usage(event)
        raise await self._fail(error_from_router(event, self._job.request_id))

    async def aclose(self) -> None:
        await self._end(None)

    async def end_with(self, event: object) -> None:
        """Ends the stream on the gateway's own last event (the safety stage's Filtered): every tap sees it,
        then the call is cancelled (the engine aborts the request) and the taps end."""
        if not self._ended:
            for on_event in self._on_event:
                on_event(event)
        await self.aclose()

    def _start(self) -> AsyncIterator[StreamEvent]:
        ctx, job = self._ctx, self._job
        metering = self._metering = Metering(ctx.metrics, job)
        principal = job.principal
        telemetry = GatewayRequestTelemetry(job.request_id, job.model.name, principal.tier, principal.tenant,
                                            metering.timer, job.num_prompt_tokens)
        self._taps = [metering, telemetry, *self._taps]  # the meter's timer ends before telemetry reads it
        if ctx.ledger is not None:
            self._ledger_tap = UsageLedgerTap(ctx.ledger, job.request, requested_model=self._requested_model,
                                              key_id=principal.key_id, streamed=self._streamed,
                                              batch_item=principal.batch_item,
                                              withheld=lambda: self.num_withheld_tokens,
                                              price_factor=principal.price_factor)
            self._taps.append(self._ledger_tap)
        self._on_event = tuple(tap.on_event for tap in self._taps)
        call = ctx.backend.generate(job.to_proto(self._requested_model), telemetry.outgoing_metadata())
        self._call = self._reading = call
        return call

    async def _fail(self, error: GatewayError, cause: BaseException | None = None) -> GatewayError:
        error.__cause__ = cause  # before the taps see it (raise ... from sets it only later)
        await self._end(error)
        return error

    async def _end(self, error: GatewayError | None) -> None:
        if self._ended:
            return
        self._ended = True
        call, self._reading = self._call, None
        try:
            if call is not None:
                await call.aclose()  # cancels an unfinished call: the engine aborts the request
        finally:
            if self.num_withheld_tokens:
                for on_event in self._on_event:
                    on_event(Withheld(self.num_withheld_tokens))
            for tap in self._taps:
                tap.on_end(error)

    def _with_usage(self, finished: Finished) -> Finished:
        """The router counts the caller's prompt and every token it relayed; a router that did not is
        counted here."""
        usage = finished.usage
        if usage.prompt_tokens and usage.completion_tokens:
            return finished
        num_output_tokens = self._metering.timer.num_output_tokens  # started: the first read made it
        return replace(finished, usage=Usage(usage.prompt_tokens or self._job.num_prompt_tokens,
                                             usage.completion_tokens or num_output_tokens,
                                             usage.cached_prompt_tokens))


async def collect(events: Events) -> Generation:
    chunks: list[Chunk] = []
    async for event in events:
        if type(event) is not Chunk:  # Finished, or the safety stage's Filtered
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
