"""The linear-time held-back length equals the definition, on random texts and stop strings."""

from __future__ import annotations

import random

from flotilla.engine.stop_checker import _PrefixTracker


def _held_back(text: str, stop: str) -> int:
    return max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


def test_prefix_tracker_equals_the_definition():
    rng = random.Random(3)
    for _ in range(300):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
        tracker, text = _PrefixTracker(stop), ""
        for _ in range(rng.randint(0, 12)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            tracker.feed(piece)
            text += piece
            assert tracker.state == _held_back(text, stop), (stop, text)
