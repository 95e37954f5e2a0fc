"""The benchmark's requests: random-token prompts and forced output lengths, the same for every system."""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]  # every system is forced to produce exactly this many tokens per request

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def subset(self, indices: list[int]) -> Workload:
        return Workload([self.prompts[i] for i in indices], [self.max_tokens[i] for i in indices])

    def waves(self, size: int) -> list[Workload]:
        """Consecutive waves of `size` requests, in order (the last may be shorter)."""
        return [self.subset(list(range(start, min(start + size, self.num_requests))))
                for start in range(0, self.num_requests, size)]


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int  # inclusive

    def validate(self, name: str) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"{name} must satisfy 1 <= low <= high, got {self.low}..{self.high}")


def make_workload(
    num_requests: int,
    vocab_size: int,
    excluded_token_ids: Collection[int],
    prompt_lengths: LengthRange,
    output_lengths: LengthRange,
    seed: int,
) -> Workload:
    """Uniform prompt and output lengths; prompt tokens drawn from the vocabulary minus the excluded ids
    (EOS and other special tokens, so that a prompt never looks finished or templated)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    prompt_lengths.validate("prompt lengths")
    output_lengths.validate("output lengths")
    excluded = set(excluded_token_ids)
    tokens = [t for t in range(vocab_size) if t not in excluded]
    if not tokens:
        raise ValueError("no token ids left once the excluded ones are removed")
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        length = rng.randint(prompt_lengths.low, prompt_lengths.high)
        prompts.append([rng.choice(tokens) for _ in range(length)])
        max_tokens.append(rng.randint(output_lengths.low, output_lengths.high))
    return Workload(prompts, max_tokens)


def evenly_spaced(num_items: int, num_chosen: int) -> list[int]:
    """`num_chosen` indices spread over range(num_items), so a timed sample covers short and long requests
    alike rather than whatever came first."""
    num_chosen = max(1, min(num_chosen, num_items))
    return sorted({(i * num_items) // num_chosen for i in range(num_chosen)})
