"""An answer's text, streamed, split into text and tool calls without ever leaking part of a call as text.

ToolCallStream.feed(text) returns what is certain so far: text, and each tool call once its end marker arrived (or,
for syntaxes whose calls run to the end of the answer, at finish()). Text is held back while its end could be the
start of a marker, and so is whitespace right before a marker (and whitespace-only text once a call was made),
so the client sees neither `<tool_` nor the newline a model writes between calls. A call whose text does not parse
is given back as the text it was (the model wrote it; it is not a call).

The worker's text drops special tokens; a syntax whose marker is one (Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`) gets it back from the chunk's token ids (`MarkerTokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from flotilla.gateway.tool_parsers import ParsedCall, ToolCallSyntax
from flotilla.rpc.stream_events import Chunk

Item = str | ParsedCall  # text, or one whole tool call


class ToolCallStream:
    def __init__(self, syntax: ToolCallSyntax):
        self._syntax = syntax
        self._pending = ""  # text held back
        self._marker = ""  # the start marker of the call being read (given back with it if it does not parse)
        self._call_text: str | None = None  # inside a call: its text so far
        self._emitted_text = False
        self.num_calls = 0

    def feed(self, text: str) -> list[Item]:
        items: list[Item] = []
        if self._call_text is not None:
            self._call_text += text
            self._close_call(items)
        else:
            self._pending += text
            self._scan(items)
        return items

    def finish(self) -> list[Item]:
        items: list[Item] = []
        if self._call_text is not None:
            call_text, self._call_text = self._call_text, None
            self._add_calls(items, call_text)
        self._text(items, self._pending)
        self._pending = ""
        return items

    def _scan(self, items: list[Item]) -> None:
        found = self._find_marker()
        if found is None:
            held = self._num_held()
            self._text(items, self._pending[:len(self._pending) - held])
            self._pending = self._pending[len(self._pending) - held:]
            return
        position, marker, keep = found
        self._text(items, self._pending[:position].rstrip())
        self._marker = "" if keep else marker
        self._call_text = self._pending[position + (0 if keep else len(marker)):]
        self._pending = ""
        self._close_call(items)

    def _find_marker(self) -> tuple[int, str, bool] | None:
        """(position, marker, kept in the call's text) of the first marker in the pending text."""
        pending = self._pending
        if not self._emitted_text and self.num_calls == 0:
            start = len(pending) - len(pending.lstrip())
            for marker in self._syntax.leading_markers:
                if pending.startswith(marker, start):
                    return start, marker, True
        hits = [(pending.find(m), m) for m in self._syntax.start_markers if m in pending]
        if not hits:
            return None
        position, marker = min(hits)
        return position, marker, False

    def _num_held(self) -> int:
        """Length of the pending text's tail that may still become (whitespace and) a marker."""
        pending = self._pending
        if not self._emitted_text and self.num_calls == 0 and self._syntax.leading_markers and not pending.strip():
            return len(pending)  # nothing but whitespace yet: the answer may still open with a leading marker
        markers = self._syntax.start_markers
        held = next((n for n in range(min(len(pending), max(map(len, markers)) - 1), 0, -1)
                     if any(m.startswith(pending[-n:]) for m in markers)), 0)
        body = pending[:len(pending) - held]
        return held + len(body) - len(body.rstrip())

    def _close_call(self, items: list[Item]) -> None:
        end = self._syntax.end_marker
        position = self._call_text.find(end) if end else -1
        if position < 0:
            return
        call_text, rest = self._call_text[:position], self._call_text[position + len(end):]
        self._call_text = None
        self._add_calls(items, call_text, end)
        self._pending = rest
        self._scan(items)

    def _add_calls(self, items: list[Item], call_text: str, end: str = "") -> None:
        calls = self._syntax.parse(call_text.strip())
        if calls is None:
            self._text(items, self._marker + call_text + end)
            return
        items += calls
        self.num_calls += len(calls)

    def _text(self, items: list[Item], text: str) -> None:
        if not text or (self.num_calls and not text.strip()):
            return
        items.append(text)
        self._emitted_text = True


class MarkerTokens:
    """Puts back into a chunk's text the special-token markers the worker's detokenizer dropped."""

    def __init__(self, syntax: ToolCallSyntax, token_to_id: Callable[[str], int | None],
                 special_token_ids: Iterable[int], decode: Callable[[Sequence[int]], str]):
        special = frozenset(special_token_ids)
        ids = {marker: token_to_id(marker) for marker in syntax.markers}
        self._markers: Mapping[int, str] = {i: m for m, i in ids.items() if i is not None and i in special}
        self._decode = decode

    def text(self, chunk: Chunk) -> str:
        markers = self._markers
        if not markers or not any(token_id in markers for token_id in chunk.token_ids):
            return chunk.text
        # Segments of ordinary tokens between markers; the first one's text is what the others' leave of it.
        found, segments = [], [[]]
        for token_id in chunk.token_ids:
            if token_id in markers:
                found.append(markers[token_id])
                segments.append([])
            else:
                segments[-1].append(token_id)
        later = [self._decode(segment) if segment else "" for segment in segments[1:]]
        tail = "".join(later)
        if not chunk.text.endswith(tail):
            later, tail = [""] * len(found), ""  # cannot place them: the markers go after the text
        head = chunk.text[:len(chunk.text) - len(tail)]
        return head + "".join(marker + text for marker, text in zip(found, later))
