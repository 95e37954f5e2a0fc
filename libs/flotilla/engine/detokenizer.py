"""Streaming detokenization: turn generated token ids into text deltas as they arrive.

A token need not end on a character boundary (byte-level BPE splits multi-byte UTF-8 characters across
tokens), and some decoders change a token's text depending on its neighbours (SentencePiece strips the
leading space of the first token). So, as vLLM and TGI do, we decode a short window of recent tokens and
emit only what it adds beyond the already-emitted part of the window:

    ids:   ... | prefix_offset ... read_offset | new tokens
                 \\___ already emitted ____/

and hold text back while the decoded window ends in U+FFFD, the replacement character a decoder puts
where a character is still incomplete. Each push costs O(window) work, not a re-decode of the output.

SentencePiece byte fallback decodes a run of <0xNN> tokens all at once, and an invalid byte later in the
run turns the whole run into U+FFFDs, so text is also held while the last token is a byte token.
"""

from __future__ import annotations

from collections.abc import Sequence

from flotilla.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context, enough for decoders that look at the previous token.
NUM_PROMPT_CONTEXT_TOKENS = 5
# Ids before the window are dropped once this many pile up, so memory stays O(window) too.
MAX_STALE_TOKENS = 1024


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, delivered in complete-character deltas.

    Contract: the concatenation of every push() delta and the final flush() equals
    tokenizer.decode(all pushed ids, skip_special_tokens). With prompt_token_ids, the prompt is left
    context only (its text is not emitted); it keeps e.g. SentencePiece's first output space. (A prompt
    of raw token ids that ends inside a character is not supported: that character belongs to neither.)
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        # Skipped special tokens are dropped before decoding: decode() drops them anyway, and a window
        # that starts with one would make the next token look like a sequence start to the decoder.
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._byte_token_ids = tokenizer.byte_fallback_token_ids
        self._token_ids: list[int] = self._kept(prompt_token_ids or ())
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(0, self._read_offset - NUM_PROMPT_CONTEXT_TOKENS)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the new text that is complete (possibly "")."""
        deltas = []
        for token_id in self._kept(token_ids):
            self._token_ids.append(token_id)
            deltas.append(self._advance(final=False))
        return self._emit("".join(deltas))

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a genuinely invalid byte sequence at the end)."""
        return self._emit(self._advance(final=True))

    def _advance(self, final: bool) -> str:
        window_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(window_text) <= len(self._prefix_text):
            return ""
        if not final and (window_text.endswith(REPLACEMENT_CHAR) or self._token_ids[-1] in self._byte_token_ids):
            return ""  # the last character may still be incomplete, or its byte run may still turn invalid
        delta = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        if self._prefix_offset > MAX_STALE_TOKENS:
            del self._token_ids[: self._prefix_offset]
            self._prefix_offset, self._read_offset = 0, self._read_offset - self._prefix_offset
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=False)

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        return [int(token_id) for token_id in token_ids if token_id not in self._skipped_ids]

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta
