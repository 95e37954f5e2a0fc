"""POST /v1/messages (the Anthropic Messages API: text and custom tools, streamed or not) and
POST /v1/messages/count_tokens."""

from __future__ import annotations

from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.gateway import field_support
from flotilla.gateway.admission import admit
from flotilla.gateway.anthropic_prompt import encode_prompt, template_tools
from flotilla.gateway.anthropic_schema import CountTokensRequest, MessagesRequest, PromptParams
from flotilla.gateway.anthropic_stream import PING, content_blocks, message_body, message_events
from flotilla.gateway.auth import authenticate
from flotilla.gateway.body import parse_body, read_body
from flotilla.gateway.connection_limits import hold_stream_slot
from flotilla.gateway.context import GatewayContext, arrival_time, dialect_endpoint, gateway_context, request_id
from flotilla.gateway.dialects import Dialect
from flotilla.gateway.conversation_key import conversation_key
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.generation import (Job, check_context_window, checked_sampling, collect, router_events,
                                         tokenize, until_disconnected)
from flotilla.gateway.model_registry import ServedModel
from flotilla.gateway.safety.stage import screen_prompt, screened
from flotilla.gateway.sse import SSEResponse, first_event
from flotilla.gateway.structured_params import anthropic_structured_output
from flotilla.gateway.tool_calling import ToolSetup, tool_setup
from flotilla.gateway.tool_grammar import decoding_constraint


@dialect_endpoint(Dialect.ANTHROPIC)
async def create_message(request: Request) -> Response:
    ctx = gateway_context(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(MessagesRequest, await read_body(request, ctx.settings.max_body_bytes),
                        field_support.check_messages)
    requested, model = await _resolve(ctx, params)
    tools = _tool_setup(ctx, model, params)
    requested_output = anthropic_structured_output(params.output_config.format if params.output_config else None,
                                                   params.output_format)
    constraint = decoding_constraint(tools, template_tools(params), params.forced_tool, params.single_tool_call,
                                     model.tokenizer, requested_output)
    sampling = checked_sampling(max_tokens=params.max_tokens, temperature=_or(params.temperature, 1.0),
                                top_p=_or(params.top_p, 1.0), top_k=_or(params.top_k, 0),
                                stop=tuple(params.stop_sequences or ()), structured_output=constraint)
    prompt_ids = await tokenize(encode_prompt, model.tokenizer, params)
    check_context_window(len(prompt_ids), params.max_tokens, model.max_model_len)
    if params.stream:
        hold_stream_slot(request, principal)  # before admission: a refused stream holds no quota
    policy = await screen_prompt(ctx.safety, ctx.metrics, principal, model.tokenizer, prompt_ids)
    admitted = await admit(request, ctx.gatekeeper, ctx.settings.admission, Dialect.ANTHROPIC, principal,
                           request_id(request), len(prompt_ids), params.max_tokens, model=model.name)
    user_id = params.metadata.user_id if params.metadata is not None else None
    job = Job.create(request_id(request), model, principal, prompt_ids, sampling, arrival_time(request),
                     admitted.ticket, conversation_key(principal.tenant, user_id, params.system, params.messages))
    events = screened(router_events(ctx, job, requested, admitted, streamed=bool(params.stream)), policy, ctx.metrics,
                      job.num_prompt_tokens)
    message_id = "msg_" + job.request_id.removeprefix("req_")
    if params.stream:
        first = await first_event(request, events)
        return SSEResponse(message_events(message_id, job, first, events, ctx.metrics, tools), ping=PING)
    async with aclosing(events):
        generation = await until_disconnected(request, collect(events))
    items, num_calls = tools.items(generation.chunks) if tools is not None else ([generation.text], 0)
    return JSONResponse(message_body(message_id, job.model.name, content_blocks(items), generation.finished,
                                     num_calls=num_calls))


@dialect_endpoint(Dialect.ANTHROPIC)
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens exactly as POST /v1/messages would count them (its usage: input + cache reads)."""
    ctx = gateway_context(request)
    await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(CountTokensRequest, await read_body(request, ctx.settings.max_body_bytes),
                        field_support.check_count_tokens)
    _, model = await _resolve(ctx, params)
    _tool_setup(ctx, model, params)
    prompt_ids = await tokenize(encode_prompt, model.tokenizer, params)
    return JSONResponse({"input_tokens": len(prompt_ids)})


async def _resolve(ctx: GatewayContext, params: PromptParams) -> tuple[str, ServedModel]:
    requested = params.model or ctx.settings.default_model
    if not requested:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model: Field required", param="model")
    return requested, await ctx.registry.resolve(requested)


def _tool_setup(ctx: GatewayContext, model: ServedModel, params: PromptParams) -> ToolSetup | None:
    return tool_setup(model.tokenizer, template_tools(params) or [], ctx.settings.tool_call_parser)


def _or(value, default):
    return default if value is None else value
