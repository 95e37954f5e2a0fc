"""A tiny random checkpoint and transformers' greedy output on it, built once per session; the shared tiny engine
(tests/support/engines.py) for the AsyncEngine tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from flotilla.models.checkpoint import write_checkpoint

from tests.support.engines import tiny_engine  # noqa: F401

SYSTEM_PROMPT_LEN = 64
NUM_PROMPTS = 16


@dataclass
class Reference:
    model_dir: str
    prompts: list[list[int]]
    max_tokens: list[int]
    expected: list[list[int]]  # transformers' greedy continuation of each prompt
    eos_token_ids: list[int]


def _prompts(vocab_size: int, eos: set[int]) -> list[list[int]]:
    """8 prompts of 8-600 random tokens, and 8 that share a 64-token system prompt (prefix hits)."""
    rng = random.Random(1234)
    tokens = [t for t in range(vocab_size) if t not in eos]
    lengths = [8, 17, 33, 100, 257, 400, 511, 600]
    prompts = [[rng.choice(tokens) for _ in range(n)] for n in lengths]
    system = [rng.choice(tokens) for _ in range(SYSTEM_PROMPT_LEN)]
    for n in [1, 5, 16, 31, 64, 90, 200, 300]:
        prompts.append(system + [rng.choice(tokens) for _ in range(n)])
    return prompts


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_ids,
        pad_token_id=eos_token_ids[0],
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Reference:
    from transformers import AutoModelForCausalLM

    from flotilla.engine.tokenizer import Tokenizer

    model_dir = str(write_checkpoint(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0))
    eos = list(Tokenizer.from_pretrained(model_dir).eos_token_ids)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, set(eos))
    max_tokens = [12 + (i * 7) % 13 for i in range(len(prompts))]
    with torch.inference_mode():
        expected = [hf_greedy(hf, p, n, eos) for p, n in zip(prompts, max_tokens)]
    return Reference(model_dir, prompts, max_tokens, expected, eos)
