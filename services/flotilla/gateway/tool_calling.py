"""Tool calling for one request: check the model can take tools, choose its parser, split its answer.

Tools reach the model only through its chat template (`tools=` as transformers passes them: OpenAI-style function
definitions). A template that does not render them would drop them silently, so such a model refuses tools (400).
The parser is the syntax the template teaches (tool_parsers.syntax_for_template) unless the gateway's
--tool-call-parser names one.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.tool_parsers import SYNTAXES, ToolCallSyntax, syntax_for_template
from flotilla.gateway.tool_stream import Item, MarkerTokens, ToolCallStream
from flotilla.rpc.stream_events import Chunk

PROBE_TOOL_NAME = "flotilla_probe_tool_7c1e"
PARSER_CHOICES = ("auto", *SYNTAXES)


@dataclass(frozen=True)
class ToolSetup:
    """How to read one model's tool calls."""

    syntax: ToolCallSyntax
    markers: MarkerTokens

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.syntax)

    def items(self, chunks: Iterable[Chunk]) -> tuple[list[Item], int]:
        """A whole answer split into text and calls; and the number of calls."""
        stream, items = self.stream(), []
        for chunk in chunks:
            items += stream.feed(self.markers.text(chunk))
        items += stream.finish()
        return items, stream.num_calls


def tool_setup(tokenizer: Any, tools: Sequence[dict[str, Any]], parser: str = "auto") -> ToolSetup | None:
    """None without tools; a 400 when the model's template does not render tools or no parser is known for it."""
    if not tools:
        return None
    if not renders_tools(tokenizer):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "tools is not supported by this model: its chat template does "
                           "not render tools", param="tools", code="unsupported_field")
    name = parser if parser != "auto" else syntax_for_template(tokenizer.select_chat_template(None, tools))
    if name is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "tools is not supported by this model: no tool-call parser "
                           "matches its chat template (the gateway's --tool-call-parser names one)",
                           param="tools", code="unsupported_field")
    syntax = SYNTAXES[name]
    markers = MarkerTokens(syntax, tokenizer.token_to_id, tokenizer.special_token_ids, tokenizer.decode)
    return ToolSetup(syntax, markers)


@functools.lru_cache(maxsize=64)
def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows the model the tools it is given (checked once per tokenizer)."""
    probe = [{"type": "function", "function": {"name": PROBE_TOOL_NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "hi"}]
    try:
        return PROBE_TOOL_NAME in tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=probe)
    except Exception:  # a template that cannot render a plain conversation with tools cannot take them
        return False


def call_id(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(18).replace("-", "a").replace("_", "b")


def template_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool as chat templates take it (an OpenAI-style function definition)."""
    function: dict[str, Any] = {"name": name}  # in this order: templates write the tools with tojson
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def template_call(call_id_: str, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """A past tool call as chat templates take it (arguments as an object, as transformers documents)."""
    return {"id": call_id_, "type": "function", "function": {"name": name, "arguments": arguments}}

