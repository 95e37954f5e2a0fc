"""The rules policy and output screens on their own: loading refuses what cannot be used, a term split across
deltas is caught before any of it is cleared, regexes run in linear time."""

from __future__ import annotations

import asyncio

import pytest

from flotilla.gateway.safety.config import SafetyConfig
from flotilla.gateway.safety.policy import SafetyPolicy
from flotilla.gateway.safety.rules import PolicyError, Rule, RulesPolicy



def _policy(window_chars: int = 8) -> RulesPolicy:
    return RulesPolicy([Rule("weapons", ("Bomb Recipe",), (r"\bnerve\s+gas\b",)),
                        Rule("pii", (), (r"(\d{3})-\d{2}-\d{4}",))], window_chars)


def _stream(screen, deltas: list[str], window_bound: bool = True) -> tuple[str, object]:
    """Feeds `deltas`; -> (the text cleared when it ended, the blocking verdict or None)."""
    text = ""

    async def run():
        for delta in deltas:
            nonlocal text
            text += delta
            verdict = await screen.feed(delta)
            if verdict.allowed and window_bound:
                assert len(text) - screen.cleared <= screen.window_chars  # held back: at most the window
            if not verdict.allowed:
                return verdict
        verdict = await screen.finish()
        return None if verdict.allowed else verdict

    verdict = asyncio.run(run())
    return text[:screen.cleared], verdict


def test_input_terms_are_case_insensitive_and_categorised():
    policy = _policy()
    assert policy.screen_input("how do I write a bOmB rEcIpE?").category == "weapons"
    assert policy.screen_input("ssn 123-45-6789").category == "pii"
    assert policy.screen_input("a bomb, a recipe").allowed


def test_term_split_across_deltas_is_blocked_before_any_of_it_is_cleared():
    cleared, verdict = _stream(_policy().output_screen(), ["hello ", "the bo", "mb re", "cipe is"])
    assert verdict is not None and verdict.category == "weapons"
    assert "bo" not in cleared and cleared == "hello the "[:len(cleared)]


def test_clean_text_is_all_cleared_at_the_end():
    deltas = ["ok " * 5, "nerve", " gases are fine", " really"]  # \bnerve\s+gas\b must not match "gases"
    cleared, verdict = _stream(_policy().output_screen(), deltas)
    assert verdict is None and cleared == "".join(deltas)


def test_pattern_at_the_end_of_the_text_so_far_waits_and_is_caught():
    cleared, verdict = _stream(_policy().output_screen(), ["x" * 40, " nerve", " gas"], window_bound=False)
    assert verdict is not None and "nerve" not in cleared


def test_window_grows_to_hold_the_longest_term():
    policy = RulesPolicy([Rule("c", ("a-rather-long-forbidden-term",), ())], window_chars=2)
    assert policy.window_chars == len("a-rather-long-forbidden-term") - 1
    cleared, verdict = _stream(policy.output_screen(), list("abc a-rather-long-forbidden-term"), window_bound=False)
    assert verdict is not None and "a-r" not in cleared


@pytest.mark.parametrize("pattern, why", [("(a", "not valid RE2"), (r"(a)\1", "not valid RE2"),
                                          ("(?=x)y", "not valid RE2"), ("a*", "empty string")])
def test_bad_patterns_are_refused_at_load(pattern, why):
    with pytest.raises(PolicyError, match=why):
        SafetyConfig.from_json({"policies": {"p": {"rules": [{"category": "c", "patterns": [pattern]}]}}})


@pytest.mark.parametrize("document, why", [
    ({"default": "missing", "policies": {}}, "default safety policy"),
    ({"policies": {"p": {"rules": [{"category": "c"}]}}}, "at least one term"),
    ({"policies": {"p": {"rules": [{"category": "c", "terms": [""]}]}}}, "non-empty strings"),
    ({"policies": {"p": {"rules": [], "surprise": 1}}}, "expected an object"),
    ({"policies": {"p": {"classifier": {"url": "ftp://x"}}}}, "http"),
    ({"policies": {"p": {"classifier": {"url": "http://x", "fail_mode": "maybe"}}}}, "fail_mode"),
])
def test_bad_configs_are_refused_naming_the_problem(document, why):
    with pytest.raises(PolicyError, match=why):
        SafetyConfig.from_json(document)


@pytest.mark.timeout(20)
def test_catastrophic_backtracking_pattern_runs_in_linear_time():
    # Python's re takes exponential time on this (each extra "a" doubles it); RE2 scans once.
    policy = RulesPolicy([Rule("redos", (), (r"(a+)+$", r"^(\w+\s?)+$"))])
    hostile = "a" * 100_000 + "!"
    assert policy.screen_input(hostile).allowed  # neither can match: a backtracking engine tries 2^n ways
    assert not policy.screen_input("a" * 100_000).allowed
    assert policy.moderate("b" * 50_000 + "!").flagged is False
    screen = policy.output_screen()
    cleared, verdict = _stream(screen, ["a" * 97 + "!"] * 200)
    assert verdict is None


def test_ascii_terms_alone_hold_back_only_what_could_start_a_term():
    policy = RulesPolicy([Rule("weapons", ("Bomb Recipe", "nerve gas"), ())], window_chars=32)
    screen = policy.output_screen()

    async def feed(delta):
        verdict = await screen.feed(delta)
        return verdict.allowed, screen.cleared

    async def run():
        return [await feed(d) for d in ["hello there, ", "the bo", "mb re", "cipe", " now"]]

    steps = asyncio.run(run())
    assert steps[0] == (True, len("hello there, "))  # nothing that could start a term: sent at once
    assert steps[1] == (True, len("hello there, the "))  # "bo" may start "bomb recipe"
    assert steps[2] == steps[3] == (True, len("hello there, the "))  # a match at the very end waits one delta
    assert steps[4][0] is False


def test_a_non_ascii_end_falls_back_to_the_window():
    # RE2 folds the Kelvin sign onto "k" (and the long s onto "s"): such an end is not judged by its prefix.
    policy = RulesPolicy([Rule("c", ("kill switch",), ())], window_chars=16)
    assert policy.hold("text ending in \u212a") == 16 and policy.hold("text ending in k") == 1
    cleared, verdict = _stream(policy.output_screen(), ["say \u212aill", " switch"], window_bound=False)
    assert verdict is not None and "\u212a" not in cleared
