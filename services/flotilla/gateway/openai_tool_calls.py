"""Chat completion answers with tool calls: the message's `tool_calls` and finish reason `tool_calls`, and in a stream
the `delta.tool_calls` entries (id, type and name first, then the arguments), text as `delta.content`."""

from __future__ import annotations

from collections.abc import Iterable

from flotilla.engine.request import FinishReason
from flotilla.gateway.safety.filtered import CONTENT_FILTER_CODE, Filtered
from flotilla.gateway.tool_calling import ToolSetup, call_id
from flotilla.gateway.tool_parsers import ParsedCall
from flotilla.gateway.tool_stream import Item, ToolCallStream
from flotilla.rpc.stream_events import Chunk, Finished


class ToolCalls:
    """How one request's answer is read: its tool-call syntax, and whether only the first call is kept
    (parallel_tool_calls false)."""

    def __init__(self, setup: ToolSetup, first_only: bool):
        self.setup = setup
        self.first_only = first_only

    def choice(self, chunks: Iterable[Chunk], finished: Finished) -> dict:
        items, _ = self.setup.items(chunks)
        calls = [item for item in items if isinstance(item, ParsedCall)][:1 if self.first_only else None]
        text = "".join(item for item in items if isinstance(item, str))
        message = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
        if calls:
            message["tool_calls"] = [_tool_call(call) for call in calls]
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(finished, calls)}

    def stream(self) -> StreamedToolCalls:
        return StreamedToolCalls(self)


class StreamedToolCalls:
    """A stream's choices: feed each chunk, then finish with the Finished event."""

    def __init__(self, calls: ToolCalls):
        self._calls = calls
        self._stream: ToolCallStream = calls.setup.stream()
        self._num_calls = 0

    def feed(self, chunk: Chunk) -> list[dict]:
        return self._choices(self._stream.feed(self._calls.setup.markers.text(chunk)))

    def finish(self, finished: Finished) -> list[dict]:
        choices = self._choices(self._stream.finish())
        reason = finish_reason(finished, [None] * self._num_calls)
        return [*choices, {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}]

    def _choices(self, items: list[Item]) -> list[dict]:
        choices = []
        for item in items:
            if isinstance(item, str):
                choices.append(_delta({"content": item}))
            elif not (self._calls.first_only and self._num_calls):
                call, index = _tool_call(item), self._num_calls
                self._num_calls += 1
                opening = {"index": index, "id": call["id"], "type": "function",
                           "function": {"name": item.name, "arguments": ""}}
                choices.append(_delta({"tool_calls": [opening]}))
                choices.append(_delta({"tool_calls": [{"index": index, "function": {"arguments": item.arguments}}]}))
        return choices


def finish_reason(finished: Finished | Filtered, calls: list) -> str:
    if type(finished) is Filtered:
        return CONTENT_FILTER_CODE
    if finished.reason is FinishReason.LENGTH:
        return "length"
    return "tool_calls" if calls else "stop"


def _tool_call(call: ParsedCall) -> dict:
    return {"id": call_id("call_"), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _delta(delta: dict) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
