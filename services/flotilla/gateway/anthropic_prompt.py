"""An Anthropic request's prompt: system, messages (text, tool_use, tool_result) and tools through the model's chat
template. POST /v1/messages and POST /v1/messages/count_tokens both count with this, so they agree exactly."""

from __future__ import annotations

from typing import Any

from flotilla.gateway.anthropic_schema import PromptParams, TextBlock, ToolResultBlock, ToolUseBlock
from flotilla.gateway.model_registry import TokenizerLike
from flotilla.gateway.tool_calling import template_call, template_tool


def template_tools(params: PromptParams) -> list[dict[str, Any]] | None:
    tools = [template_tool(t.name, t.description, t.input_schema) for t in params.active_tools]
    return tools or None


def template_messages(params: PromptParams) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if params.system_text is not None:
        messages.append({"role": "system", "content": params.system_text})
    tool_names: dict[str, str] = {}  # tool_use id -> name, for the results that answer it
    for message in params.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        calls = [b for b in message.content if isinstance(b, ToolUseBlock)]
        results = [b for b in message.content if isinstance(b, ToolResultBlock)]
        for result in results:  # they answer the previous assistant turn, so they come before any text
            messages.append(_tool_message(result, tool_names.get(result.tool_use_id)))
        if calls:
            tool_names.update((c.id, c.name) for c in calls)
            messages.append({"role": message.role, "content": text,
                             "tool_calls": [template_call(c.id, c.name, c.input) for c in calls]})
        elif text or not results:
            messages.append({"role": message.role, "content": text})
    return messages


def encode_prompt(tokenizer: TokenizerLike, params: PromptParams) -> list[int]:
    messages, tools = template_messages(params), template_tools(params)
    last = messages[-1]
    if last["role"] == "assistant" and "tool_calls" not in last:
        # A trailing assistant turn is a prefill: the answer continues that text rather than a new turn.
        prefix = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tools=tools)
        return tokenizer.encode(prefix + last["content"], add_special_tokens=False)
    return tokenizer.encode_chat(messages, tools=tools)


def _tool_message(result: ToolResultBlock, name: str | None) -> dict[str, Any]:
    message = {"role": "tool", "content": result.text, "tool_call_id": result.tool_use_id}
    if name is not None:
        message["name"] = name
    return message
