"""Health that checks the output: a GPU can fail with the process up and its answers wrong (a flipped bit in a
weight, a bad kernel after a driver update). At load the worker records a short greedy generation of a fixed
prompt; then it generates it again every few seconds when idle, less often when busy, and compares. A
mismatch marks the worker unhealthy at the router (its LoadReport carries the reason) until it restarts.

The check is one ordinary request through the engine, batched with whatever runs: at most GOLDEN_TOKENS
decode steps' worth of one sequence plus a ~20-token prefill per check. Each check uses a fresh cache salt so
the prompt is computed again rather than read from the prefix cache.

What is compared is the *confident* prefix: greedy tokens whose top-1 logprob leads top-2 by `min_margin`
nats at load, up to the first one that does not (a near tie can flip between batch shapes with no fault), and
each token's logprob within `logprob_tolerance` (a weight scaled a little moves logprobs before it flips
tokens). Both bounds follow the serving dtype (check_settings.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.worker.check_settings import CheckSettings, Tolerances

logger = logging.getLogger(__name__)

GOLDEN_PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"
GOLDEN_TOKENS = 8
CHECK_TIMEOUT_S = 60.0  # a check stuck behind a full queue is slow, not wrong: given up and tried later


@dataclass(frozen=True)
class GoldenSample:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # the confident prefix of the greedy output at load
    logprobs: tuple[float, ...]


class OutputCheck:
    def __init__(self, engine: AsyncEngine, settings: CheckSettings | None = None,
                 on_result: Callable[[str], None] = lambda result: None):
        """`on_result("pass" | "fail" | "timeout")` after every check (metrics)."""
        settings = settings or CheckSettings()
        self._engine = engine
        self._settings = settings
        self._tolerances = Tolerances.for_dtype(str(engine.engine.dtype).removeprefix("torch."), settings)
        self._on_result = on_result
        self._ids = itertools.count()
        self.golden: GoldenSample | None = None
        self.failure = ""  # non-empty once a check failed: why; sticky until the worker restarts
        self.num_checks = 0

    async def record(self) -> GoldenSample:
        """The reference generation; run once at load, before the worker takes work."""
        prompt = self._prompt()
        token_ids, logprobs, margins = await self._generate(prompt, num_top=2)
        confident = next((i for i, margin in enumerate(margins) if margin < self._tolerances.min_margin), len(margins))
        self.golden = GoldenSample(prompt, tuple(token_ids[:confident]), tuple(logprobs[:confident]))
        logger.info("output check recorded %d of %d golden tokens", confident, len(token_ids))
        return self.golden

    async def check_once(self) -> bool:
        """Generate the golden prompt again; False (and `failure` set) when the output differs."""
        if self.golden is None:
            raise RuntimeError("record() first")
        if not self.golden.token_ids:
            return True  # no step was confident at load (a degenerate model): nothing to compare
        token_ids, logprobs, _ = await self._generate(self.golden.prompt_token_ids, num_top=0,
                                                      num_tokens=len(self.golden.token_ids))
        self.num_checks += 1
        problem = _compare(self.golden, token_ids, logprobs, self._tolerances.logprob_tolerance)
        if problem and not self.failure:
            self.failure = f"output check failed: {problem}"
            logger.error("%s; the worker reports itself unhealthy", self.failure)
        return not problem

    async def run_forever(self) -> None:
        last_check = time.monotonic()
        while True:
            await asyncio.sleep(self._settings.interval_s)  # a periodic timer, not a wait for something
            busy = self._engine.is_running and self._engine.stats().num_running > 0
            if busy and time.monotonic() - last_check < self._settings.busy_interval_s:
                continue
            last_check = time.monotonic()
            try:
                passed = await asyncio.wait_for(self.check_once(), CHECK_TIMEOUT_S)
            except TimeoutError:
                logger.warning("output check did not finish in %.0f s; trying again later", CHECK_TIMEOUT_S)
                self._on_result("timeout")
                continue
            self._on_result("pass" if passed else "fail")

    def _prompt(self) -> tuple[int, ...]:
        ids = self._engine.engine.tokenizer.encode(GOLDEN_PROMPT)
        room = max(1, self._engine.engine.max_model_len - GOLDEN_TOKENS)
        return tuple(ids[-room:])

    async def _generate(self, prompt: tuple[int, ...], num_top: int, num_tokens: int = GOLDEN_TOKENS
                        ) -> tuple[list[int], list[float], list[float]]:
        """(greedy tokens, their logprobs, top-1 minus top-2 logprob per token when num_top >= 2)."""
        check_id = next(self._ids)
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=num_top)
        request = NewRequest(f"output-check-{check_id}", prompt, params, cache_salt=f"output-check-{check_id}-{time.time_ns()}")
        stream = await self._engine.generate(request)
        token_ids: list[int] = []
        logprobs: list[float] = []
        margins: list[float] = []
        try:
            async for output in stream:
                token_ids += output.new_token_ids
                for entry in output.logprobs:
                    logprobs.append(entry.logprob)
                    tops = sorted((logprob for _, logprob in entry.top), reverse=True)
                    margins.append(tops[0] - tops[1] if len(tops) >= 2 else float("inf"))
        finally:
            stream.close()
        return token_ids, logprobs, margins


def _compare(golden: GoldenSample, token_ids: list[int], logprobs: list[float], tolerance: float) -> str:
    for i, (expected, got) in enumerate(zip(golden.token_ids, token_ids)):
        if expected != got:
            return f"token {i} is {got}, recorded {expected}"
        if abs(golden.logprobs[i] - logprobs[i]) > tolerance:
            return f"token {i} logprob {logprobs[i]:.4f}, recorded {golden.logprobs[i]:.4f}"
    if len(token_ids) < len(golden.token_ids):
        return f"{len(token_ids)} tokens, recorded {len(golden.token_ids)}"
    return ""
