"""POST /v1/messages: the Anthropic Messages API (text content), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flotilla.engine.request import FinishReason
from flotilla.gateway.admission import admit
from flotilla.gateway.anthropic_schema import MessagesRequest
from flotilla.gateway.auth import authenticate
from flotilla.gateway.body import parse_body, read_body
from flotilla.gateway.context import arrival_time, dialect_endpoint, gateway_context, request_id
from flotilla.gateway.dialects import Dialect, error_body
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.generation import (Job, check_context_window, checked_sampling, collect, router_events,
                                         tokenize, until_disconnected)
from flotilla.gateway.model_registry import TokenizerLike
from flotilla.gateway.structured_params import anthropic_structured_output
from flotilla.gateway.sse import Events, SSEResponse, first_event, sse_json
from flotilla.rpc.stream_events import Chunk, Finished, Usage


@dialect_endpoint(Dialect.ANTHROPIC)
async def create_message(request: Request) -> Response:
    ctx = gateway_context(request)
    principal = await authenticate(request.headers, ctx.gatekeeper)
    params = parse_body(MessagesRequest, await read_body(request, ctx.settings.max_body_bytes))
    requested = params.model or ctx.settings.default_model
    if not requested:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model: Field required", param="model")
    model = await ctx.registry.resolve(requested)
    sampling = checked_sampling(max_tokens=params.max_tokens, temperature=_or(params.temperature, 1.0),
                                top_p=_or(params.top_p, 1.0), top_k=_or(params.top_k, 0),
                                stop=tuple(params.stop_sequences or ()),
                                structured_output=anthropic_structured_output(params.output_config))
    prompt_ids = await tokenize(encode_messages, model.tokenizer, params)
    check_context_window(len(prompt_ids), params.max_tokens, model.max_model_len)
    admitted = await admit(request, ctx.gatekeeper, ctx.settings.admission, Dialect.ANTHROPIC, principal,
                           request_id(request), len(prompt_ids), params.max_tokens)
    job = Job.create(request_id(request), model, principal, prompt_ids, sampling, arrival_time(request),
                     admitted.ticket)
    events = router_events(ctx, job, requested, admitted)
    message_id = "msg_" + job.request_id.removeprefix("req_")
    if params.stream:
        first = await first_event(request, events)
        return SSEResponse(_message_events(message_id, job, first, events, ctx.metrics), ping=PING)
    async with aclosing(events):
        generation = await until_disconnected(request, collect(events))
    return JSONResponse(message_body(message_id, job.model.name, [_text_block(generation.text)], generation.finished))


def encode_messages(tokenizer: TokenizerLike, params: MessagesRequest) -> list[int]:
    messages: list[dict[str, Any]] = []
    if params.system_text is not None:
        messages.append({"role": "system", "content": params.system_text})
    messages += [{"role": m.role, "content": m.text} for m in params.messages]
    if messages[-1]["role"] == "assistant":
        # A trailing assistant turn is a prefill: the answer continues that text rather than a new turn.
        prefix = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
        return tokenizer.encode(prefix + messages[-1]["content"], add_special_tokens=False)
    return tokenizer.encode_chat(messages)


def message_body(message_id: str, model: str, content: list[dict], finished: Finished | None,
                 usage: dict | None = None) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(finished) if finished else None,
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": usage if usage is not None else usage_body(finished.usage)}


def usage_body(usage: Usage) -> dict:
    # Anthropic counts cache reads apart from input_tokens: total input = input + cache reads.
    return {"input_tokens": usage.prompt_tokens - usage.cached_prompt_tokens,
            "cache_read_input_tokens": usage.cached_prompt_tokens, "output_tokens": usage.completion_tokens}


async def _message_events(message_id: str, job: Job, first: Chunk | Finished, events: Events,
                          metrics) -> AsyncIterator[bytes]:
    metrics.streams_in_flight.inc()
    try:
        start_usage = {"input_tokens": job.num_prompt_tokens, "output_tokens": 0}
        start = message_body(message_id, job.model.name, [], None, usage=start_usage)
        yield sse_json({"type": "message_start", "message": start}, "message_start")
        yield sse_json({"type": "content_block_start", "index": 0, "content_block": _text_block("")},
                       "content_block_start")
        yield PING
        event = first
        while type(event) is Chunk:
            if event.text:
                delta = {"type": "text_delta", "text": event.text}
                yield sse_json({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
            event = await anext(events)
        yield sse_json({"type": "content_block_stop", "index": 0}, "content_block_stop")
        delta = {"stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence}
        yield sse_json({"type": "message_delta", "delta": delta, "usage": usage_body(event.usage)}, "message_delta")
        yield sse_json({"type": "message_stop"}, "message_stop")
    except GatewayError as err:
        yield sse_json(error_body(Dialect.ANTHROPIC, err), "error")
    finally:
        metrics.streams_in_flight.dec()
        await events.aclose()


PING = sse_json({"type": "ping"}, "ping")


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _stop_reason(finished: Finished) -> str:
    if finished.reason is FinishReason.LENGTH:
        return "max_tokens"
    return "stop_sequence" if finished.stop_sequence else "end_turn"


def _or(value, default):
    return default if value is None else value
