"""Forced tool calls: `tool_choice` required / any / a named tool as a grammar over the model's own tool-call
syntax (tool_parsers.py), so the engine's constrained decoding (engine/structured_output.py) makes the answer
one or more calls, each naming an offered tool with arguments that validate against that tool's parameters.

The grammar is Lark with inline JSON Schemas (llguidance's `%json`). A marker the tokenizer holds as a special
token is written as that token (`<[id]>`): the model emits it as it was trained to, rather than spelling its
text out in ordinary tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.structured_output import JSON_LAYOUT, StructuredOutput, compile_grammar
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.tool_parsers import ToolCallSyntax

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_call_grammar(syntax: ToolCallSyntax, tools: Sequence[dict[str, Any]], name: str | None,
                        single: bool, marker_token: Callable[[str], str]) -> StructuredOutput:
    """`tools` as chat templates take them ({"type": "function", "function": {...}}); `name`: only that tool;
    `single`: exactly one call; `marker_token(marker)`: the marker as a Lark terminal."""
    offered = [tool["function"] for tool in tools]
    if name is not None:
        offered = [f for f in offered if f["name"] == name]
        if not offered:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"tool_choice names {name!r}, which is not among the tools",
                               param="tool_choice")
    arguments_key = "parameters" if syntax.name == "llama3_json" else "arguments"
    call = _call_schema(offered, arguments_key)
    body = f"%json {json.dumps(call)}"
    many = "" if single else " (SEPARATOR call)*"
    if syntax.name == "hermes":
        start, end = marker_token("<tool_call>"), marker_token("</tool_call>")
        rules = [f"start: call{many.replace('SEPARATOR', 'NL')}", f'call: {start} "\\n" body "\\n" {end}', 'NL: "\\n"']
    elif syntax.name == "llama3_json":
        rules = [f"start: call{many.replace('SEPARATOR', 'SEMI')}", "call: body", 'SEMI: "; "']
    elif syntax.name == "mistral":
        rules = [f'start: {marker_token("[TOOL_CALLS]")} "[" call{many.replace("SEPARATOR", "COMMA")} "]"',
                 "call: body", 'COMMA: ", "']
    else:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"tool_choice cannot force calls in the {syntax.name} syntax",
                           param="tool_choice")
    return StructuredOutput("grammar", "\n".join([*rules, f"body: {body}"]))


def marker_terminal(token_to_id: Callable[[str], int | None], special_token_ids: frozenset[int]) -> Callable[[str], str]:
    def terminal(marker: str) -> str:
        token_id = token_to_id(marker)
        return f"<[{token_id}]>" if token_id is not None and token_id in special_token_ids else json.dumps(marker)

    return terminal


def _call_schema(functions: Sequence[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    variants = [{"type": "object",
                 "properties": {"name": {"const": f["name"]}, arguments_key: f.get("parameters") or ANY_OBJECT},
                 "required": ["name", arguments_key], "additionalProperties": False}
                for f in functions]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": JSON_LAYOUT}


def decoding_constraint(setup: Any, tools: Sequence[dict[str, Any]] | None, forced: tuple[bool, str | None],
                        single: bool, tokenizer: Any, requested: StructuredOutput | None) -> StructuredOutput | None:
    """The request's one constraint: its structured-output field, or the grammar of a forced tool call.
    `setup`: the request's ToolSetup (None without tools); `forced`: (required, tool name or None)."""
    required, name = forced
    if not required:
        return requested
    if setup is None or not tools:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "tool_choice forces a tool call but no tools are given",
                           param="tool_choice")
    if requested is not None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "a forced tool call and a structured output cannot be asked "
                           "for together", param="tool_choice")
    terminal = marker_terminal(tokenizer.token_to_id, frozenset(tokenizer.special_token_ids))
    grammar = forced_call_grammar(setup.syntax, tools, name, single, terminal)
    try:
        compile_grammar(grammar)
    except InvalidRequestError as err:  # a tool's parameters that are no JSON Schema llguidance takes
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"tools: {err.message}", param="tools") from err
    return grammar
