"""The golden check of a rollout: fixed prompts (token ids valid in any vocabulary), greedy, run once on a
worker of the candidate and one of the current version when the rollout starts; how many answers are identical
and how long the common prefix is, for `flotilla models status` next to the latency and error figures. A signal
for the operator, not a gate: a retrained model is expected to differ, a re-quantised one mostly not."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.router.registry import WorkerEntry, WorkerRegistry

logger = logging.getLogger(__name__)

GOLDEN_PROMPTS = ((1, 2, 3, 4, 5, 6), (7, 7, 7, 11, 13), (42, 17, 99, 3, 64, 21, 8))
NUM_TOKENS = 8
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GoldenResult:
    baseline: str
    candidate: str
    num_prompts: int = 0
    num_identical: int = 0
    mean_common_prefix: float = 0.0  # tokens, out of NUM_TOKENS
    error: str = ""
    done: bool = False


async def greedy(entry: WorkerEntry, prompt: tuple[int, ...]) -> list[int]:
    request = pb.GenerateRequest(
        request_id=f"golden-{uuid.uuid4().hex[:12]}", model=f"{entry.model_name}@{entry.version}",
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    call = entry.session.generate(request, timeout=CALL_TIMEOUT_S)
    try:
        async for response in call:
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
            elif response.HasField("error"):
                raise RuntimeError(response.error.message)
    finally:
        call.cancel()
    return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def compare(registry: WorkerRegistry, name: str, baseline: str, candidate: str) -> GoldenResult:
    picked = {}
    for version in (baseline, candidate):
        workers = registry.healthy_workers(name, version)
        if not workers:
            return GoldenResult(baseline, candidate, error=f"no healthy worker of {name}@{version}", done=True)
        picked[version] = workers[0]
    try:
        answers = [await asyncio.gather(greedy(picked[baseline], p), greedy(picked[candidate], p))
                   for p in GOLDEN_PROMPTS]
    except Exception as err:  # a lost worker, a timeout: reported, the rollout goes on
        logger.warning("golden check of %s@%s failed: %s", name, candidate, err)
        return GoldenResult(baseline, candidate, error=str(err) or type(err).__name__, done=True)
    prefixes = [_common_prefix(a, b) for a, b in answers]
    result = GoldenResult(baseline, candidate, len(answers), sum(a == b for a, b in answers),
                          sum(prefixes) / len(prefixes), done=True)
    logger.info("golden check of %s@%s against %s: %d of %d identical", name, candidate, baseline,
                result.num_identical, result.num_prompts)
    return result
