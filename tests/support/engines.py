"""One offline engine on the shared tiny checkpoint (64 blocks of 16 tokens), and greedy references from it.

Import `tiny_engine` into the conftest.py of a folder that uses it (tests/engine, tests/fleet/router_worker).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NUM_KV_BLOCKS = 64
BLOCK_SIZE = 16


def engine_config(model_dir: Path):
    from flotilla.engine.config import EngineConfig

    return EngineConfig(model_dir=str(model_dir), device="cpu", num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE)


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint):
    """One LLMEngine for offline references and for AsyncEngine tests (which hand it back idle)."""
    import torch

    from flotilla.engine.engine import LLMEngine

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return LLMEngine(engine_config(tiny_checkpoint))


def greedy_reference(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from flotilla.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [result.token_ids for result in engine.generate(prompts, params)]
