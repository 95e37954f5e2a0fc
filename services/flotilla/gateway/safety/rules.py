"""The rules policy: case-insensitive literal terms and regular expressions, each under a category.

Everything compiles into one RE2 pattern (linear time in the text, whatever the pattern: no backtracking, so
no catastrophic cases; backreferences and lookarounds, which need backtracking, are refused). A pattern that
does not compile, or that matches the empty string (it would block everything), is refused when the policy
is loaded, naming the rule.

The output screen scans a bounded tail of the answer on each delta: the held-back window plus as much again
of cleared text before it, so a term split across tokens or SSE events is seen whole, and \\b sees the
character before the tail. It holds back the window, except for a policy of ASCII terms only: then only the end
of the answer that could still be the start of a term waits (most deltas wait not at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import re2

from flotilla.gateway.safety.verdict import ALLOW, Moderation, Verdict

DEFAULT_WINDOW_CHARS = 32


class PolicyError(ValueError):
    """A safety configuration that cannot be used; the message names what is wrong."""


@dataclass(frozen=True)
class Rule:
    category: str
    terms: tuple[str, ...] = ()  # literal, case-insensitive
    patterns: tuple[str, ...] = ()  # RE2 syntax, as written (add (?i) for case-insensitive)

    @classmethod
    def from_json(cls, item: object, where: str) -> Rule:
        if not isinstance(item, Mapping) or not set(item) <= {"category", "terms", "patterns"}:
            raise PolicyError(f"{where}: a rule is an object with category, terms, patterns; got {item!r}")
        category = item.get("category")
        if not isinstance(category, str) or not category.strip():
            raise PolicyError(f"{where}: category must be a non-empty string, got {category!r}")
        terms, patterns = (_strings(item.get(name, []), f"{where} ({category}) {name}") for name in
                           ("terms", "patterns"))
        if not terms and not patterns:
            raise PolicyError(f"{where} ({category}): needs at least one term or pattern")
        return cls(category, terms, patterns)


class RulesPolicy:
    def __init__(self, rules: Sequence[Rule], window_chars: int = DEFAULT_WINDOW_CHARS):
        if not rules:
            raise PolicyError("a rules policy needs at least one rule")
        for rule in rules:
            for pattern in rule.patterns:
                check_pattern(pattern, f"rule {rule.category!r}")
        self.categories = tuple(dict.fromkeys(rule.category for rule in rules))
        longest_term = max((len(t) for rule in rules for t in rule.terms), default=0)
        # A term of n characters is caught before any of it is sent when n - 1 characters are held back.
        self.window_chars = max(window_chars, longest_term - 1, 1)
        self._pattern = _compile([f"(?P<c{i}>{_alternation(rule)})" for i, rule in enumerate(rules)])
        groups = self._pattern.groupindex  # the group number of each rule (a rule's own groups come between)
        self._group_categories = [(groups[f"c{i}"], rule.category) for i, rule in enumerate(rules)]
        self._by_category = {c: _compile([_alternation(r) for r in rules if r.category == c]) for c in self.categories}
        # Literal ASCII terms only: an answer need hold back no more than its end that could still begin a term.
        terms = [t.lower() for rule in rules for t in rule.terms]
        only_ascii_terms = not any(rule.patterns for rule in rules) and all(t.isascii() for t in terms)
        self._term_prefixes = {t[:k] for t in terms for k in range(1, len(t))} if only_ascii_terms else None
        self._longest_prefix = longest_term - 1

    def hold(self, text: str) -> int:
        """How many characters at the end of `text` must wait: the window, or with only ASCII terms the longest
        end that is the start of a term (the window when that end is not ASCII: RE2 folds a few other
        characters, the Kelvin sign, the long s, onto ASCII letters)."""
        if self._term_prefixes is None:
            return self.window_chars
        end = text[-self._longest_prefix:] if self._longest_prefix > 0 else ""
        if not end.isascii():
            return self.window_chars
        end = end.lower()
        return next((k for k in range(len(end), 0, -1) if end[-k:] in self._term_prefixes), 0)

    @classmethod
    def from_json(cls, rules: object, window_chars: int, where: str) -> RulesPolicy:
        if not isinstance(rules, list):
            raise PolicyError(f"{where}: rules must be a list, got {rules!r}")
        return cls([Rule.from_json(item, f"{where} rule {i}") for i, item in enumerate(rules)], window_chars)

    def screen_input(self, text: str) -> Verdict:
        match = self._pattern.search(text)
        return ALLOW if match is None else self.verdict_of(match)

    def moderate(self, text: str) -> Moderation:
        categories = {c: pattern.search(text) is not None for c, pattern in self._by_category.items()}
        return Moderation(any(categories.values()), categories)

    def output_screen(self) -> RulesScreen:
        return RulesScreen(self)

    def search(self, text: str, pos: int):
        return self._pattern.search(text, pos)

    def verdict_of(self, match) -> Verdict:
        category = next(c for group, c in self._group_categories if match.start(group) >= 0)
        return Verdict.block(category, f"matched a {category!r} rule")


class RulesScreen:
    """Scans `_tail` (the answer from `_tail_start` on) at each delta; see OutputScreen for the contract."""

    __slots__ = ("_policy", "window_chars", "cleared", "_tail", "_tail_start")

    def __init__(self, policy: RulesPolicy):
        self._policy = policy
        self.window_chars = policy.window_chars
        self.cleared = 0
        self._tail = ""
        self._tail_start = 0

    async def feed(self, delta: str) -> Verdict:
        return self._scan(delta, final=False)

    async def finish(self) -> Verdict:
        return self._scan("", final=True)

    def _scan(self, delta: str, final: bool) -> Verdict:
        tail = self._tail + delta
        end = self._tail_start + len(tail)
        context = 1 if self._tail_start > 0 else 0  # a character before the scan, for \b, never matched itself
        match = self._policy.search(tail, context)
        cleared = end if final else end - self._policy.hold(tail)
        if match is not None:
            if final or match.end() < len(tail):
                return self._policy.verdict_of(match)
            cleared = min(cleared, self._tail_start + match.start())  # what follows may undo it: wait
        self.cleared = max(self.cleared, cleared)
        # Keep the held-back text, a window of cleared text before it (a long match spanning both), and one
        # character of context.
        keep_from = max(self._tail_start, self.cleared - self.window_chars - 1)
        self._tail = tail[keep_from - self._tail_start:]
        self._tail_start = keep_from
        return ALLOW


def _alternation(rule: Rule) -> str:
    return "|".join([f"(?i:{re2.escape(term)})" for term in rule.terms] + [f"(?:{p})" for p in rule.patterns])


def _compile(parts: list[str]):
    return re2.compile("|".join(parts), _OPTIONS)


def _options():
    options = re2.Options()
    options.log_errors = False
    return options


_OPTIONS = _options()


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PolicyError(f"{where}: must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def check_pattern(pattern: str, where: str) -> None:
    """Refuses what RE2 cannot compile (with its reason) and what matches the empty string."""
    try:
        compiled = re2.compile(pattern, _OPTIONS)
    except re2.error as err:
        raise PolicyError(f"{where}: pattern {pattern!r} is not valid RE2 syntax: {_message(err)}") from None
    if compiled.search("") is not None:
        raise PolicyError(f"{where}: pattern {pattern!r} matches the empty string (it would block everything)")


def _message(err: Exception) -> str:
    detail = err.args[0] if err.args else err
    return detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
