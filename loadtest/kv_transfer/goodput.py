"""Goodput (requests meeting both a TTFT and a TPOT target, per second) of the real fleet, colocated (two
workers of role both) vs disaggregated (one prefill + one decode worker), on the same mix of long prompts and
short chats at a fixed concurrency, streamed through the gateway."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import openai

from flotilla.fleet.local import FleetConfig, LocalFleet


class Goodput(NamedTuple):
    layout: str
    num_requests: int
    num_good: int
    wall_s: float
    ttft_p50_s: float
    tpot_p50_s: float

    @property
    def goodput_rps(self) -> float:
        return self.num_good / self.wall_s


def workload(num_long: int, num_short: int, long_words: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = ["tide", "knot", "sail", "anchor", "harbour", "compass", "ship", "mast"]
    long = [(f"Report {i}: " + " ".join(rng.choice(words) for _ in range(long_words)), 16) for i in range(num_long)]
    short = [(f"Chat {i}: how is the {rng.choice(words)} today?", 32) for i in range(num_short)]
    mixed = long + short
    rng.shuffle(mixed)
    return mixed


def run(model_dir: Path, layout: str, requests, concurrency: int, ttft_target_s: float, tpot_target_s: float,
        worker_args: list[str]) -> Goodput:  # fmt: skip
    disagg = layout == "disaggregated"
    config = FleetConfig(
        model_dir=model_dir, state_dir=Path(tempfile.mkdtemp(prefix=f"goodput-{layout}-")),
        num_workers=0 if disagg else 2, num_prefill_workers=int(disagg), num_decode_workers=int(disagg),
        worker_args=worker_args, metrics=False,
    )  # fmt: skip
    with LocalFleet(config) as fleet:
        samples, wall_s = asyncio.run(_drive(fleet, requests, concurrency))
    good = [s for s in samples if s[0] <= ttft_target_s and s[1] <= tpot_target_s]
    return Goodput(layout, len(samples), len(good), wall_s, _median([s[0] for s in samples]),
                   _median([s[1] for s in samples]))  # fmt: skip


async def _drive(fleet: LocalFleet, requests, concurrency: int):
    client = openai.AsyncOpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = Path(fleet.config.model_dir).name
    gate = asyncio.Semaphore(concurrency)

    async def one(text: str, max_tokens: int) -> tuple[float, float]:
        async with gate:
            started = time.monotonic()
            first = last = None
            num_chunks = 0
            stream = await client.completions.create(model=model, prompt=text, max_tokens=max_tokens,
                                                     temperature=0, stream=True)  # fmt: skip
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    last = time.monotonic()
                    first = first or last
                    num_chunks += 1
            first = first or time.monotonic()
            tpot = (last - first) / max(1, num_chunks - 1) if last else 0.0
            return first - started, tpot

    started = time.monotonic()
    samples = await asyncio.gather(*(one(text, n) for text, n in requests))
    return samples, time.monotonic() - started


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")
