"""The tool-call syntaxes models write, one parser per template family, chosen from the chat template.

- `hermes` (ChatML / Hermes / Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated.
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`.

A parser only says where calls start and end and what a call's text means; tool_stream.py does the streaming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ToolCallSyntax:
    name: str
    start_markers: tuple[str, ...]  # a call starts at any of these, anywhere in the answer
    end_marker: str | None  # a call ends here; None: calls run to the end of the answer
    leading_markers: tuple[str, ...] = ()  # recognised only as the answer's first text, and kept in the call's text

    @property
    def markers(self) -> tuple[str, ...]:
        return self.start_markers + self.leading_markers + ((self.end_marker,) if self.end_marker else ())

    def parse(self, text: str) -> list[ParsedCall] | None:
        """The calls in `text` (what followed a start marker, up to the end marker); None: not tool calls."""
        try:
            return _PARSE[self.name](text)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def _call(name: Any, arguments: Any) -> ParsedCall:
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a name")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool-call arguments must be an object")
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str) -> list[ParsedCall]:
    call = json.loads(text)
    return [_call(call["name"], call.get("arguments", {}))]


def _json_values(text: str, separator: str) -> list[Any]:
    """Every JSON value in text, separated by whitespace and `separator`."""
    decoder, values, index = json.JSONDecoder(), [], 0
    while True:
        while index < len(text) and (text[index].isspace() or text[index] == separator):
            index += 1
        if index == len(text):
            return values
        value, index = decoder.raw_decode(text, index)
        values.append(value)


def _parse_llama3(text: str) -> list[ParsedCall]:
    calls = [_call(call["name"], call.get("parameters", call.get("arguments", {}))) for call in _json_values(text, ";")]
    if not calls:
        raise ValueError("no call")
    return calls


def _parse_mistral(text: str) -> list[ParsedCall]:
    calls: list[ParsedCall] = []
    for part in (p for p in text.split("[TOOL_CALLS]") if p.strip()):
        if "[ARGS]" in part:
            name, _, arguments = part.partition("[ARGS]")
            calls.append(_call(name.strip(), json.loads(arguments)))
            continue
        for value in _json_values(part, ","):
            calls += [_call(c["name"], c.get("arguments", {})) for c in (value if isinstance(value, list) else [value])]
    if not calls:
        raise ValueError("no call")
    return calls


_PARSE = {"hermes": _parse_hermes, "llama3_json": _parse_llama3, "mistral": _parse_mistral}

SYNTAXES: dict[str, ToolCallSyntax] = {
    "hermes": ToolCallSyntax("hermes", ("<tool_call>",), "</tool_call>"),
    "llama3_json": ToolCallSyntax("llama3_json", ("<|python_tag|>",), None, leading_markers=("{",)),
    "mistral": ToolCallSyntax("mistral", ("[TOOL_CALLS]",), None),
}


def syntax_for_template(template: str) -> str | None:
    """The syntax a chat template teaches its model, by the markers it writes; None: none recognised."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return None
