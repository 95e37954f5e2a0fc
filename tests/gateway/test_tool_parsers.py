"""Tool-call parsing: each syntax whole, and streamed in every split (one character at a time, and at every cut
point in two), never leaking a call's text; text that only looks like a call stays text."""

from __future__ import annotations

import json

import pytest

from flotilla.gateway.tool_parsers import SYNTAXES, ParsedCall, syntax_for_template
from flotilla.gateway.tool_stream import MarkerTokens, ToolCallStream
from flotilla.rpc.stream_events import Chunk


WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "CET"}))

# (syntax, model output, expected items: text and calls in order)
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     ["Let me check.", WEATHER, TIME]),
    ("hermes", 'No tools needed: 1 < 2 and <tool> is not a marker.', ["No tools needed: 1 < 2 and <tool> is not a marker."]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}', [WEATHER]),  # no end
    ("hermes", '<tool_call>{"name": broken}</tool_call> after', ['<tool_call>{"name": broken}</tool_call> after']),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', [WEATHER]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', [WEATHER, TIME]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": {"zone": "CET"}}', [TIME]),
    ("llama3_json", 'The answer is {"a": 1}.', ['The answer is {"a": 1}.']),
    ("llama3_json", '{"a": 1} is JSON', ['{"a": 1} is JSON']),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', [WEATHER, TIME]),
    ("mistral", 'Sure. [TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', ["Sure.", TIME]),
    ("mistral", "Plain [TOOL answer", ["Plain [TOOL answer"]),
]


def _run(syntax: str, pieces: list[str]) -> list:
    stream = ToolCallStream(SYNTAXES[syntax])
    items = [item for piece in pieces for item in stream.feed(piece)] + stream.finish()
    return _merged(items)


def _merged(items: list) -> list:
    merged: list = []
    for item in items:
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    return merged


@pytest.mark.parametrize("syntax,output,expected", CASES)
def test_whole_output(syntax, output, expected):
    assert _run(syntax, [output]) == expected


@pytest.mark.parametrize("syntax,output,expected", CASES)
def test_streamed_character_by_character(syntax, output, expected):
    assert _run(syntax, list(output)) == expected


@pytest.mark.parametrize("syntax,output,expected", CASES)
def test_streamed_in_two_at_every_cut(syntax, output, expected):
    for cut in range(len(output) + 1):
        assert _run(syntax, [output[:cut], output[cut:]]) == expected, cut


@pytest.mark.parametrize("syntax,output,expected", CASES)
def test_no_call_text_leaks_while_streaming(syntax, output, expected):
    """Whatever has been released as text at any point is a prefix of the final text: nothing is taken back."""
    final_text = "".join(i for i in expected if isinstance(i, str))
    stream, released = ToolCallStream(SYNTAXES[syntax]), ""
    for char in output:
        released += "".join(i for i in stream.feed(char) if isinstance(i, str))
        assert final_text.startswith(released), (released, final_text)


def test_hermes_marker_prefix_is_held_then_released():
    stream = ToolCallStream(SYNTAXES["hermes"])
    assert stream.feed("Hi <tool_") == ["Hi"]  # the space before a possible marker is held too
    assert stream.feed("box> ok") == [" <tool_box> ok"]
    assert stream.finish() == []


def test_syntax_from_template():
    assert syntax_for_template("{{ '<tool_call>\\n' + tool_call | tojson }}") == "hermes"
    assert syntax_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert syntax_for_template('{{ "<|python_tag|>" }}') == "llama3_json"
    assert syntax_for_template("{{ message['content'] }}") is None


class _FakeTokenizer:
    """Token 7 is the special [TOOL_CALLS]; other ids decode to a letter each."""

    def token_to_id(self, token):
        return 7 if token == "[TOOL_CALLS]" else None

    special_token_ids = frozenset({7})

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_special_marker_tokens_are_put_back():
    tok = _FakeTokenizer()
    markers = MarkerTokens(SYNTAXES["mistral"], tok.token_to_id, tok.special_token_ids, tok.decode)
    assert markers.text(Chunk((0, 1), "ab")) == "ab"
    assert markers.text(Chunk((7, 0, 1), "ab")) == "[TOOL_CALLS]ab"
    assert markers.text(Chunk((0, 7, 1), "ab")) == "a[TOOL_CALLS]b"
    assert markers.text(Chunk((0, 1, 7), "ab")) == "ab[TOOL_CALLS]"
