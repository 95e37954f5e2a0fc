"""POST /v1/chat/completions and POST /v1/completions: the OpenAI-compatible endpoints (text, function tools on
chat, n=1)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.engine.request import FinishReason
from flotilla.gateway import field_support, openai_logprobs
from flotilla.gateway.admission import admit
from flotilla.gateway.auth import Principal, authenticate
from flotilla.gateway.body import parse_body, read_body
from flotilla.gateway.connection_limits import hold_stream_slot
from flotilla.gateway.context import GatewayContext, arrival_time, dialect_endpoint, gateway_context, request_id
from flotilla.gateway.dialects import Dialect, error_body
from flotilla.gateway.conversation_key import conversation_key
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.generation import (Job, check_context_window, checked_sampling, collect, router_events,
                                         tokenize, until_disconnected)
from flotilla.gateway.model_registry import ServedModel, TokenizerLike
from flotilla.gateway.openai_prompt import template_messages, template_tools
from flotilla.gateway.openai_schema import ChatCompletionRequest, CommonParams, CompletionRequest
from flotilla.engine.structured_output import StructuredOutput
from flotilla.gateway.openai_tool_calls import ToolCalls
from flotilla.gateway.safety.filtered import CONTENT_FILTER_CODE, Filtered
from flotilla.gateway.safety.stage import screen_prompt, screened
from flotilla.gateway.sse import Events, SSEResponse, first_event, sse_data, sse_json
from flotilla.gateway.tool_calling import tool_setup
from flotilla.gateway.tool_grammar import decoding_constraint
from flotilla.rpc.stream_events import Chunk, Finished, Usage

# (text, finish_reason, logprobs) -> one choice
ChoiceFn = Callable[[str, str | None, dict | None], dict]
# (tokenizer, chunks, text offset of the first chunk) -> logprobs object
LogprobsFn = Callable[[TokenizerLike, list[Chunk], int], dict]


@dataclass(frozen=True)
class Endpoint:
    """How one endpoint shapes its answers; chat and text completions differ only here."""

    object_name: str  # of a whole answer
    chunk_object_name: str  # of a streamed chunk
    id_prefix: str
    choice: ChoiceFn  # in a whole answer
    chunk_choice: ChoiceFn  # in a streamed chunk
    opening_choice: dict | None  # sent before any text in a stream
    logprobs: LogprobsFn


@dataclass(frozen=True)
class Plan:
    """A checked request: what to ask the router for and how to answer."""

    requested_model: str
    model: ServedModel
    principal: Principal
    prompt_ids: list[int]
    max_tokens: int | None
    num_logprobs: int | None  # None: no logprobs
    params: CommonParams
    endpoint: Endpoint
    tool_calls: ToolCalls | None = None  # chat with tools: the answer is read for tool calls
    constraint: StructuredOutput | None = None  # structured output or a forced tool call's grammar


@dialect_endpoint(Dialect.OPENAI)
async def create_chat_completion(request: Request) -> Response:
    ctx = gateway_context(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(ChatCompletionRequest, await read_body(request, ctx.settings.max_body_bytes),
                        field_support.check_chat)
    max_tokens = params.max_completion_tokens if params.max_completion_tokens is not None else params.max_tokens
    _require_max_tokens(max_tokens)
    requested, model = await _resolve(ctx, params)
    tools = template_tools(params)
    setup = tool_setup(model.tokenizer, tools or [], ctx.settings.tool_call_parser)
    if setup is not None and params.logprobs:
        raise field_support.unsupported("logprobs", "logprobs together with tools are not built")
    prompt_ids = await tokenize(model.tokenizer.encode_chat, template_messages(params), tools=tools)
    num_logprobs = (params.top_logprobs or 0) if params.logprobs else None
    single = params.parallel_tool_calls is False
    tool_calls = ToolCalls(setup, first_only=single) if setup is not None else None
    constraint = decoding_constraint(setup, tools, params.forced_tool, single, model.tokenizer,
                                     params.structured_output())
    plan = Plan(requested, model, principal, prompt_ids, max_tokens, num_logprobs, params, CHAT, tool_calls,
                constraint)
    return await _generate(request, ctx, plan)


@dialect_endpoint(Dialect.OPENAI)
async def create_completion(request: Request) -> Response:
    ctx = gateway_context(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(CompletionRequest, await read_body(request, ctx.settings.max_body_bytes),
                        field_support.check_completion)
    _require_max_tokens(params.max_tokens)
    requested, model = await _resolve(ctx, params)
    prompt_ids = await _completion_prompt(model.tokenizer, params.prompt)
    plan = Plan(requested, model, principal, prompt_ids, params.max_tokens, params.logprobs, params, TEXT,
                constraint=params.structured_output())
    return await _generate(request, ctx, plan)


def _require_max_tokens(max_tokens: int | None) -> None:
    # Service policy (not OpenAI's): every request states its output budget, which admission counts.
    if max_tokens is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST,
                           "max_tokens is required (max_completion_tokens is accepted as well)", param="max_tokens")


async def _resolve(ctx: GatewayContext, params: CommonParams) -> tuple[str, ServedModel]:
    """The model (404 when unknown); what a field may be was checked before (field_support.py)."""
    requested = params.model or ctx.settings.default_model
    if not requested:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model: Field required", param="model")
    return requested, await ctx.registry.resolve(requested)


async def _completion_prompt(tokenizer: TokenizerLike, prompt: str | list) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               f"only one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await tokenize(tokenizer.encode, prompt, add_special_tokens=True)
    if not prompt:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the prompt is empty", param="prompt")
    if any(t < 0 for t in prompt):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "prompt token ids must be >= 0", param="prompt")
    return list(prompt)


async def _generate(request: Request, ctx: GatewayContext, plan: Plan) -> Response:
    params = plan.params
    sampling = checked_sampling(max_tokens=plan.max_tokens, temperature=_or(params.temperature, 1.0),
                                top_p=_or(params.top_p, 1.0), top_k=_or(params.top_k, 0), seed=params.seed,
                                stop=params.stop_list, logprobs=plan.num_logprobs, ignore_eos=params.ignore_eos,
                                structured_output=plan.constraint)
    check_context_window(len(plan.prompt_ids), sampling.max_tokens, plan.model.max_model_len)
    if params.stream:
        hold_stream_slot(request, plan.principal)  # before admission: a refused stream holds no quota
    policy = await screen_prompt(ctx.safety, ctx.metrics, plan.principal, plan.model.tokenizer, plan.prompt_ids)
    admitted = await admit(request, ctx.gatekeeper, ctx.settings.admission, Dialect.OPENAI, plan.principal,
                           request_id(request), len(plan.prompt_ids), sampling.max_tokens, model=plan.model.name)
    job = Job.create(request_id(request), plan.model, plan.principal, plan.prompt_ids, sampling,
                     arrival_time(request), admitted.ticket,
                     conversation_key(plan.principal.tenant, params.user, messages=getattr(params, "messages", ())))
    events = screened(router_events(ctx, job, plan.requested_model, admitted, streamed=bool(params.stream)), policy,
                      ctx.metrics, job.num_prompt_tokens)
    head = _Head(plan.endpoint.id_prefix + job.request_id.removeprefix("req_"), int(time.time()), plan.model.name)
    if params.stream:
        first = await first_event(request, events)
        return SSEResponse(_chunks(plan, head, first, events, ctx))
    async with aclosing(events):
        generation = await until_disconnected(request, collect(events))
    if plan.tool_calls is not None:
        choice = plan.tool_calls.choice(generation.chunks, generation.finished)
        return JSONResponse(head.body(plan.endpoint.object_name, [choice], usage_body(generation.finished.usage)))
    logprobs = (plan.endpoint.logprobs(plan.model.tokenizer, generation.chunks, 0)
                if plan.num_logprobs is not None else None)
    choice = plan.endpoint.choice(generation.text, finish_reason(generation.finished), logprobs)
    return JSONResponse(head.body(plan.endpoint.object_name, [choice], usage_body(generation.finished.usage)))


@dataclass(frozen=True)
class _Head:
    id: str
    created: int
    model: str

    def body(self, object_name: str, choices: list[dict], usage: dict | None, with_usage: bool = True) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if with_usage:
            body["usage"] = usage
        return body


async def _chunks(plan: Plan, head: _Head, first: Chunk | Finished, events: Events,
                  ctx: GatewayContext) -> AsyncIterator[bytes]:
    endpoint, include_usage = plan.endpoint, plan.params.include_usage

    def chunk(choice: dict) -> bytes:
        # With include_usage every chunk carries "usage": null; the usage comes in a last, choice-less chunk.
        return sse_json(head.body(endpoint.chunk_object_name, [choice], None, with_usage=include_usage))

    ctx.metrics.streams_in_flight.inc()
    try:
        if plan.tool_calls is not None:
            yield chunk(TOOLS_OPENING_CHOICE)  # no content yet: an answer of tool calls only has none
        elif endpoint.opening_choice is not None:
            yield chunk(endpoint.opening_choice)
        event, text_offset = first, 0
        if plan.tool_calls is not None:
            stream = plan.tool_calls.stream()
            while type(event) is Chunk:
                for choice in stream.feed(event):
                    yield chunk(choice)
                event = await anext(events)
            for choice in stream.finish(event):
                yield chunk(choice)
        while type(event) is Chunk:
            if event.text or event.token_ids:
                logprobs = (endpoint.logprobs(plan.model.tokenizer, [event], text_offset)
                            if plan.num_logprobs is not None else None)
                yield chunk(endpoint.chunk_choice(event.text, None, logprobs))
                text_offset += len(event.text)
            event = await anext(events)
        if plan.tool_calls is None:
            yield chunk(endpoint.chunk_choice("", finish_reason(event), None))
        if include_usage:
            yield sse_json(head.body(endpoint.chunk_object_name, [], usage_body(event.usage)))
        yield sse_data("[DONE]")
    except GatewayError as err:
        yield sse_json(error_body(Dialect.OPENAI, err))
    finally:
        ctx.metrics.streams_in_flight.dec()
        await events.aclose()


def finish_reason(finished: Finished | Filtered) -> str:
    if type(finished) is Filtered:
        return CONTENT_FILTER_CODE
    return "length" if finished.reason is FinishReason.LENGTH else "stop"


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def _chat_choice(text: str, reason: str | None, logprobs: dict | None) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs, "finish_reason": reason}


def _chat_chunk_choice(text: str, reason: str | None, logprobs: dict | None) -> dict:
    return {"index": 0, "delta": {"content": text} if reason is None else {}, "logprobs": logprobs,
            "finish_reason": reason}


def _text_choice(text: str, reason: str | None, logprobs: dict | None) -> dict:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _or(value, default):
    return default if value is None else value


CHAT = Endpoint("chat.completion", "chat.completion.chunk", "chatcmpl-", _chat_choice, _chat_chunk_choice,
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
                openai_logprobs.chat_logprobs)
TOOLS_OPENING_CHOICE = {"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}
TEXT = Endpoint("text_completion", "text_completion", "cmpl-", _text_choice, _text_choice, None,
                openai_logprobs.completion_logprobs)
