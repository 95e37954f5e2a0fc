"""Decides when a request is done and which text may be released to the client.

Text that could still turn into a stop string is held back: the client never sees a stop string or a
prefix of one that later completes it.
"""

from __future__ import annotations

from typing import NamedTuple

from flotilla.engine.request import FinishReason, Request


class StopDecision(NamedTuple):
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    text_delta: str


class StopChecker:
    def __init__(self, request: Request, max_model_len: int):
        self._request = request
        self._max_model_len = max_model_len
        self._stops = request.sampling_params.stop
        self._text = ""  # all text decoded so far (cut at a matched stop string); kept only with stop strings
        self._unreleased = ""  # without stop strings: this token's text, released at once
        self._num_released = 0
        self._prefixes = [_PrefixTracker(stop) for stop in self._stops]

    def after_token(self, token_id: int, new_text: str, grammar_complete: bool = False) -> StopDecision:
        """Call once per generated token with the detokenizer's new text for it; `grammar_complete`: the
        request's structured output can take no more tokens (it ends here, without waiting for an EOS)."""
        params = self._request.sampling_params
        if self._stops:
            search_from = max(0, len(self._text) - max(len(s) for s in self._stops) + 1)
            self._append(new_text)
            matched = self._find_stop_string(search_from)
            if matched is not None:
                return self._finish(FinishReason.STOP, matched)
        else:
            self._unreleased += new_text
        reason, stop_reason = self._finish_without_text(token_id, grammar_complete)
        if reason is not None:
            return self._finish(reason, stop_reason)
        return StopDecision(None, None, self._releasable(final=False))

    def finish_without_text(self, token_id: int, grammar_complete: bool = False) -> FinishReason | None:
        """Whether the token (already appended to the request) ends it by what needs no text: a stop token id, EOS,
        a complete grammar, or length. after_token() ends it then too, unless a stop string ended it first."""
        return self._finish_without_text(token_id, grammar_complete)[0]

    def _finish_without_text(self, token_id: int, grammar_complete: bool) -> tuple[FinishReason | None, int | None]:
        params = self._request.sampling_params
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if not params.ignore_eos and token_id in self._request.eos_token_ids:
            return FinishReason.STOP, token_id
        if grammar_complete:
            return FinishReason.STOP, None
        if self._request.reached_length(self._max_model_len):
            return FinishReason.LENGTH, None
        return None, None

    def replay(self, old_text: str) -> None:
        """A resumed stream: take the text of a token generated (and released) before, on another worker.
        Releasing is deterministic in the text, so the held-back tail is the one that worker held."""
        if self._stops:  # without stop strings nothing is held back: that text is all released already
            self._append(old_text)
            self._release(len(self._text) - self._held_back_length())

    def finish_with(self, final_text: str) -> str:
        """The request ended elsewhere (abort): release what was held, plus the detokenizer's tail."""
        if self._stops:
            self._text += final_text
        else:
            self._unreleased += final_text
        return self._releasable(final=True)

    def _find_stop_string(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self._text = self._text[: best[0]]
        return best[1]

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> StopDecision:
        return StopDecision(reason, stop_reason, self._releasable(final=True))

    def _releasable(self, final: bool) -> str:
        """The text the client may have now: everything but a tail that could still become a stop string."""
        if not self._stops:
            text, self._unreleased = self._unreleased, ""
            return text
        return self._release(len(self._text) if final else len(self._text) - self._held_back_length())

    def _append(self, text: str) -> None:
        self._text += text
        for tracker in self._prefixes:
            tracker.feed(text)

    def _held_back_length(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        return max((tracker.state for tracker in self._prefixes), default=0)

    def _release(self, upto: int) -> str:
        upto = max(upto, self._num_released)
        delta = self._text[self._num_released : upto]
        self._num_released = upto
        return delta


class _PrefixTracker:
    """The longest suffix of the text fed so far that is a proper prefix of `stop`, kept by Knuth-Morris-Pratt:
    amortized O(1) per character, where testing every prefix length at each token was O(len(stop)^2)."""

    def __init__(self, stop: str):
        self._stop = stop
        self._fallback = _prefix_function(stop)
        self.state = 0

    def feed(self, text: str) -> None:
        stop, fallback, state = self._stop, self._fallback, self.state
        for char in text:
            while state and stop[state] != char:
                state = fallback[state - 1]
            if stop[state] == char:
                state += 1
            if state == len(stop):  # a whole match (str.find reports it); keep its longest proper border
                state = fallback[state - 1]
        self.state = state


def _prefix_function(text: str) -> list[int]:
    """pi[i]: length of the longest proper prefix of text[:i + 1] that is also its suffix."""
    pi = [0] * len(text)
    for i in range(1, len(text)):
        k = pi[i - 1]
        while k and text[i] != text[k]:
            k = pi[k - 1]
        pi[i] = k + (text[i] == text[k])
    return pi
