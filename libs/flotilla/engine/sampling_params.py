"""Per-request sampling settings, validated before a request reaches the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.structured_output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512  # characters: each is searched for and partly held back at every token


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # per-request generator: same seed, same sample sequence
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the sampled one)
    structured_output: StructuredOutput | None = None  # decoding constrained to a schema/regex/grammar

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_tokens_limit: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise InvalidRequestError("max_tokens", f"must be <= {max_tokens_limit}, got {self.max_tokens}")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError("temperature", f"must be in [0, 2], got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings")
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequestError("stop", f"each stop string must be at most {MAX_STOP_LENGTH} characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise InvalidRequestError("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
