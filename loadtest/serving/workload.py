"""Seeded request workloads: arrival times (Poisson, bursty, all at once) and request shapes (random prompts,
multi-turn chats that share system prompts, a long-prompt mix), spread over tenants and tiers.

Everything follows from `WorkloadConfig.seed`: the same config gives the same requests at the same times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# Plain words: every byte-level BPE tokenizer (ours, vLLM's) turns them into a few tokens each.
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud ember maple "
         "harbor signal vector lantern copper meadow orbit canyon").split()
ARRIVALS = ("poisson", "bursty", "batch")


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str  # e.g. paid / free: reported separately
    api_key: str = ""  # "" = the run's default key
    weight: float = 1.0  # share of the requests


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # offset from the start of the run
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    tenant: str
    tier: str
    api_key: str
    kind: str  # short, chat or long


@dataclass
class WorkloadConfig:
    num_requests: int = 100
    rate: float = math.inf  # requests per second; inf = all at t=0
    arrival: str = "poisson"  # poisson, bursty (rate x spike_factor during spikes) or batch
    spike_factor: float = 3.0
    spike_every_s: float = 10.0  # a spike starts every this many seconds ...
    spike_length_s: float = 2.0  # ... and lasts this long
    input_words: tuple[int, int] = (16, 64)  # uniform range of prompt words for short requests
    output_tokens: tuple[int, int] = (16, 64)  # uniform range of max_tokens
    chat_share: float = 0.0  # share of multi-turn chats with a shared system prompt
    num_system_prompts: int = 4
    system_prompt_words: int = 120
    max_turns: int = 4
    long_share: float = 0.0  # share of long prompts
    long_input_words: tuple[int, int] = (400, 800)
    tenants: tuple[Tenant, ...] = (Tenant("default", "paid"),)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.num_requests <= 0 or self.rate <= 0:
            raise ValueError("num_requests and rate must be > 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, not {self.arrival!r}")
        if not 0 <= self.chat_share + self.long_share <= 1:
            raise ValueError("chat_share + long_share must be within [0, 1]")
        if not self.tenants:
            raise ValueError("at least one tenant")


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    config.validate()
    rng = random.Random(config.seed)
    arrivals = arrival_times(config, rng)
    systems = [_words(rng, config.system_prompt_words) for _ in range(config.num_system_prompts)]
    weights = [t.weight for t in config.tenants]
    specs = []
    for index, arrival_s in enumerate(arrivals):
        tenant = rng.choices(config.tenants, weights)[0]
        kind, messages = _messages(config, rng, systems)
        specs.append(RequestSpec(index, arrival_s, messages, rng.randint(*config.output_tokens), tenant.name,
                                 tenant.tier, tenant.api_key, kind))
    return specs


def arrival_times(config: WorkloadConfig, rng: random.Random) -> list[float]:
    """Poisson: exponential gaps at `rate`; bursty: a Poisson process whose rate is multiplied by
    `spike_factor` during spikes (thinning of the peak rate); batch or an infinite rate: all at 0."""
    if config.arrival == "batch" or math.isinf(config.rate):
        return [0.0] * config.num_requests
    peak = config.rate * (config.spike_factor if config.arrival == "bursty" else 1.0)
    times, now = [], 0.0
    while len(times) < config.num_requests:
        now += rng.expovariate(peak)
        if rng.random() < _rate_at(config, now) / peak:
            times.append(now)
    return times


def _rate_at(config: WorkloadConfig, t: float) -> float:
    if config.arrival != "bursty":
        return config.rate
    in_spike = (t % config.spike_every_s) < config.spike_length_s
    return config.rate * (config.spike_factor if in_spike else 1.0)


def _messages(config: WorkloadConfig, rng: random.Random, systems: list[str]) -> tuple[str, tuple[dict, ...]]:
    draw = rng.random()
    if draw < config.chat_share:
        turns = rng.randint(1, config.max_turns)
        messages = [{"role": "system", "content": rng.choice(systems)}]
        for turn in range(turns):
            messages.append({"role": "user", "content": _words(rng, rng.randint(*config.input_words))})
            if turn < turns - 1:
                messages.append({"role": "assistant", "content": _words(rng, rng.randint(8, 32))})
        return "chat", tuple(messages)
    if draw < config.chat_share + config.long_share:
        return "long", ({"role": "user", "content": _words(rng, rng.randint(*config.long_input_words))},)
    return "short", ({"role": "user", "content": _words(rng, rng.randint(*config.input_words))},)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))
