"""Structured outputs: decoding constrained by a JSON Schema, a regex, a list of choices or a grammar. This
module is the request side (the spec, its compiled grammar; no torch, the gateway imports it);
grammar_backend.py applies it to the logits.

llguidance (Rust, no dependencies; one of the two engines vLLM and SGLang use) turns the spec into a
grammar over bytes and, per step, into a bitmask over the model's vocabulary: a token is allowed when its
bytes can continue a string the grammar accepts. Masked-out logits become -inf before sampling, so what the
request generates always parses: the grammar guarantees it, not the model. The mask is computed for all
constrained rows of a step in one call (llguidance spreads them over threads, without the GIL).

Per request, a matcher follows the tokens generated so far. A stream resumed on another worker replays
its delivered tokens through a new matcher before sampling, so the output still parses across a failover.
When the grammar can accept nothing more, the request stops (no need to wait for the model's EOS).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from flotilla.engine.errors import InvalidRequestError

StructuredKind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar")
FIELD = "structured_output"
# JSON as json.dumps writes it: the separators models saw most, and no free whitespace (with it, a weak model
# can spend its whole max_tokens on blank lines inside an object).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # how errors name the request field (the gateway maps it to its dialect's)


@dataclass(frozen=True)
class StructuredOutput:
    """`kind` json: `spec` is a JSON Schema as JSON text (`{"type": "object"}` for any JSON object);
    regex: a regular expression the whole output matches; choice: a JSON list of the allowed strings;
    grammar: a Lark or GBNF grammar."""

    kind: StructuredKind
    spec: str


def any_json_object() -> StructuredOutput:
    return StructuredOutput("json", '{"type": "object"}')


@lru_cache(maxsize=256)
def compile_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar for a spec, compiled once per spec (cached); InvalidRequestError if invalid."""
    import llguidance

    if spec.kind not in KINDS:
        raise InvalidRequestError(FIELD, f"unknown kind {spec.kind!r}; one of {', '.join(KINDS)}")
    try:
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise InvalidRequestError(FIELD, "choice needs a non-empty list of strings")
        if spec.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_LAYOUT)
        else:
            grammar = llguidance.grammar_from(spec.kind, spec.spec)
    except (ValueError, TypeError) as err:  # malformed JSON, an unknown format, a grammar llguidance rejects
        raise InvalidRequestError(FIELD, f"invalid {spec.kind}: {err}") from err
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(FIELD, f"invalid {spec.kind}: {error}")
    return grammar
