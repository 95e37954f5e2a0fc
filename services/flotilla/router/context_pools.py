"""Long-context pool, pure: which pools a request may be placed on, in order of preference.

A prompt longer than its model's threshold is *long*. Long prompts go to workers registered with the pool
label `long-context` (their own KV budget and step token budget, sized for long prefills), never to the
default pool while a long-context worker of the model version is healthy; with none, they fall back to the
default pool's workers whose context window holds the prompt (a stated fallback: a long prompt then shares
the default pool rather than waiting for a pool that is not there). Short prompts go to the default pool first and
to a long-context worker only while it runs no long request and no long request waits for the model: the
pool is lent out when idle, not shared with its own traffic. A model without a threshold has no long
prompts (its long-context workers then serve short prompts when idle).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from flotilla.router.placement import WorkerLoad

LONG_CONTEXT_POOL = "long-context"
DEFAULT_POOL = "default"
POOLS = (DEFAULT_POOL, LONG_CONTEXT_POOL)


def pool_label(pool: str) -> str:
    """A worker's pool as metrics and logs name it: "" is the default pool."""
    return pool or DEFAULT_POOL


@dataclass(frozen=True)
class ContextThresholds:
    """Prompt tokens above which a request is long, per model name; `default` for models not listed (0: none)."""

    per_model: Mapping[str, int] = field(default_factory=dict)
    default: int = 0

    def __post_init__(self) -> None:
        if self.default < 0 or any(tokens < 1 for tokens in self.per_model.values()):
            raise ValueError("long-context thresholds must be >= 1 token (a default of 0: none)")

    def for_model(self, name: str) -> int:
        return self.per_model.get(name, self.default)

    def is_long(self, name: str, num_prompt_tokens: int) -> bool:
        threshold = self.for_model(name)
        return threshold > 0 and num_prompt_tokens > threshold

    @classmethod
    def parse(cls, items: Iterable[str]) -> ContextThresholds:
        """`MODEL=TOKENS` for one model, a bare `TOKENS` for every other model; raises ValueError."""
        per_model: dict[str, int] = {}
        default = 0
        for item in items:
            name, sep, tokens = item.rpartition("=")
            if sep and not name:
                raise ValueError(f"expected MODEL=TOKENS or TOKENS, got {item!r}")
            try:
                value = int(tokens)
            except ValueError:
                raise ValueError(f"expected MODEL=TOKENS or TOKENS, got {item!r}") from None
            if name:
                per_model[name] = value
            else:
                default = value
        return cls(per_model, default)


class PoolRequest(NamedTuple):
    """What the pool choice needs to know about a request beyond its prompt length."""

    long_context: bool = False  # the prompt is over its model's threshold
    long_waiting: bool = False  # a long request of the same model waits in the router's queue


def pool_tiers(loads: Iterable[WorkerLoad], num_prompt_tokens: int, request: PoolRequest) -> list[list[WorkerLoad]]:
    """The workers a request may go to, as tiers: placement tries each tier in turn and takes the first worker
    with room. With no long-context worker and a short prompt: one tier, every worker (no pools)."""
    loads = list(loads)
    long_pool = [load for load in loads if load.pool == LONG_CONTEXT_POOL]
    default_pool = [load for load in loads if load.pool != LONG_CONTEXT_POOL]
    if request.long_context:
        if long_pool:
            return [long_pool]
        # None fits: the default pool all the same, whose worker answers with the context-length error at once
        # (better than a wait for a pool that is not there).
        return [[load for load in default_pool if fits(load, num_prompt_tokens)] or default_pool]
    lent = [] if request.long_waiting else [load for load in long_pool if load.num_long_requests == 0]
    return [default_pool, lent]


def fits(load: WorkerLoad, num_prompt_tokens: int) -> bool:
    """The worker's context window holds the prompt (an unknown window, 0, holds any)."""
    return load.max_model_len == 0 or num_prompt_tokens < load.max_model_len
