"""A chat completion request's prompt: messages (text, tool calls, tool results) and function tools through the
model's chat template."""

from __future__ import annotations

import json
from typing import Any

from flotilla.gateway.openai_schema import ChatCompletionRequest, ChatMessage
from flotilla.gateway.tool_calling import template_call, template_tool


def template_tools(params: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    tools = [template_tool(t.function.name, t.function.description, t.function.parameters)
             for t in params.active_tools]
    return tools or None


def template_messages(params: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [_message(m) for m in params.messages]


def _message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": message.text}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [template_call(c.id, c.function.name, _arguments(c.function.arguments))
                                  for c in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments(arguments: str) -> dict[str, Any] | str:
    """Templates render arguments objects (transformers' convention); text that is no JSON object stays text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
