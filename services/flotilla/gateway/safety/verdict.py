"""What a safety check answers, and the interface every policy's output screen implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    category: str = ""  # why it was blocked: a rule's category, a classifier's, or "unavailable"
    reason: str = ""  # for logs; never the matched text (it may be what must not be shown)
    unavailable: bool = False  # blocked only because a classifier could not be asked (fail closed)

    @classmethod
    def block(cls, category: str, reason: str, unavailable: bool = False) -> Verdict:
        return cls(False, category, reason, unavailable)


ALLOW = Verdict(True)
UNAVAILABLE_CATEGORY = "unavailable"


class OutputScreen(Protocol):
    """One answer's screen. Contract: `cleared` (characters from the start of the answer judged safe to send)
    only grows; after an allowed feed() at most `window_chars` characters are not cleared (a rules match that
    ends exactly at the end of the text so far also waits, from its start, for the next delta: what follows
    may undo it, as in `\\bterm\\b`); after an allowed finish() everything is. A block is final."""

    cleared: int
    window_chars: int

    async def feed(self, delta: str) -> Verdict: ...

    async def finish(self) -> Verdict: ...


@dataclass(frozen=True, slots=True)
class Moderation:
    """One text's result for POST /v1/moderations: every category the policy knows, and which matched."""

    flagged: bool
    categories: dict[str, bool]
