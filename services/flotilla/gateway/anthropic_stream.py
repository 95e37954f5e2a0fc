"""The SSE events of a streamed /v1/messages answer: message_start, content blocks (text, and tool_use blocks whose
input arrives as input_json_delta), message_delta with the stop reason and usage, message_stop."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

from flotilla.engine.request import FinishReason
from flotilla.gateway.dialects import Dialect, error_body
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.generation import Job
from flotilla.gateway.safety.filtered import Filtered
from flotilla.gateway.sse import Events, sse_json
from flotilla.gateway.tool_calling import ToolSetup, call_id
from flotilla.gateway.tool_parsers import ParsedCall
from flotilla.gateway.tool_stream import Item
from flotilla.rpc.stream_events import Chunk, Finished, Usage

PING = sse_json({"type": "ping"}, "ping")


class Blocks:
    """The message's content blocks, opened and closed in order; consecutive text goes into one text block."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self._open: str | None = None  # the open block's type

    def item(self, item: Item) -> Iterator[bytes]:
        if isinstance(item, ParsedCall):
            return self.tool_use(item)
        return self.text(item)

    def text(self, text: str) -> Iterator[bytes]:
        if self._open != "text":
            yield from self.close()
            yield self._start(text_block(""))
            self._open = "text"
        if text:
            delta = {"type": "text_delta", "text": text}
            yield sse_json({"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta},
                           "content_block_delta")

    def tool_use(self, call: ParsedCall) -> Iterator[bytes]:
        yield from self.close()
        yield self._start({"type": "tool_use", "id": call_id("toolu_"), "name": call.name, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        yield sse_json({"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta},
                       "content_block_delta")
        yield from self._stop()

    def close(self) -> Iterator[bytes]:
        if self._open is not None:
            yield from self._stop()

    def _start(self, block: dict) -> bytes:
        self.num_blocks += 1
        return sse_json({"type": "content_block_start", "index": self.num_blocks - 1, "content_block": block},
                        "content_block_start")

    def _stop(self) -> Iterator[bytes]:
        self._open = None
        yield sse_json({"type": "content_block_stop", "index": self.num_blocks - 1}, "content_block_stop")


async def message_events(message_id: str, job: Job, first: Chunk | Finished, events: Events, metrics,
                         tools: ToolSetup | None) -> AsyncIterator[bytes]:
    metrics.streams_in_flight.inc()
    try:
        start_usage = {"input_tokens": job.num_prompt_tokens, "output_tokens": 0}
        start = message_body(message_id, job.model.name, [], None, usage=start_usage)
        yield sse_json({"type": "message_start", "message": start}, "message_start")
        blocks, stream = Blocks(), tools.stream() if tools is not None else None
        if stream is None:
            for data in blocks.text(""):  # one text block, opened at once
                yield data
        yield PING
        event = first
        while type(event) is Chunk:
            items = [event.text] if stream is None else stream.feed(tools.markers.text(event))
            for item in items:
                for data in blocks.item(item):
                    yield data
            event = await anext(events)
        if type(event) is Filtered:  # blocked by the safety stage: an error event ends the stream
            raise event.error()
        for item in stream.finish() if stream is not None else ():
            for data in blocks.item(item):
                yield data
        for data in (blocks.text("") if blocks.num_blocks == 0 else ()):
            yield data
        for data in blocks.close():
            yield data
        num_calls = stream.num_calls if stream is not None else 0
        delta = {"stop_reason": stop_reason(event, num_calls), "stop_sequence": event.stop_sequence}
        yield sse_json({"type": "message_delta", "delta": delta, "usage": usage_body(event.usage)}, "message_delta")
        yield sse_json({"type": "message_stop"}, "message_stop")
    except GatewayError as err:
        yield sse_json(error_body(Dialect.ANTHROPIC, err), "error")
    finally:
        metrics.streams_in_flight.dec()
        await events.aclose()


def message_body(message_id: str, model: str, content: list[dict], finished: Finished | None,
                 usage: dict | None = None, num_calls: int = 0) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(finished, num_calls) if finished else None,
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": usage if usage is not None else usage_body(finished.usage)}


def content_blocks(items: list[Item]) -> list[dict]:
    """A whole answer's content: text blocks and tool_use blocks in order (one empty text block for nothing)."""
    blocks: list[dict] = []
    for item in items:
        if isinstance(item, ParsedCall):
            blocks.append(tool_use_block(item))
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += item
        else:
            blocks.append(text_block(item))
    return blocks or [text_block("")]


def usage_body(usage: Usage) -> dict:
    # Anthropic counts cache reads apart from input_tokens: total input = input + cache reads.
    return {"input_tokens": usage.prompt_tokens - usage.cached_prompt_tokens,
            "cache_read_input_tokens": usage.cached_prompt_tokens, "output_tokens": usage.completion_tokens}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def tool_use_block(call: ParsedCall) -> dict:
    return {"type": "tool_use", "id": call_id("toolu_"), "name": call.name, "input": json.loads(call.arguments)}


def stop_reason(finished: Finished | Filtered, num_calls: int = 0) -> str:
    if type(finished) is Filtered:
        return "refusal"  # the Messages API's stop reason for a stopped, unsafe answer
    if finished.reason is FinishReason.LENGTH:
        return "max_tokens"
    if num_calls:
        return "tool_use"
    return "stop_sequence" if finished.stop_sequence else "end_turn"
