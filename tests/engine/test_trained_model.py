"""The engine on trained weights (SmolLM2-135M-Instruct, the default model): greedy output equals transformers'
on the same dequantized checkpoint token for token, the chat template renders as transformers' and the
answers make sense. A random checkpoint cannot show the last, and hides near-ties a trained model has."""

from __future__ import annotations

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.tokenizer import Tokenizer

from tests.support.trained_model import MAX_TOKENS

TEMPLATE_CASES = [
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "Hi"}], False),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}], True),
    ([{"role": "user", "content": "Prices: 1234 dollars, café, <|im_end|> inline"}], True),
]


@pytest.fixture(scope="module")
def engine(trained_checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(trained_checkpoint), num_kv_blocks=128))


def test_greedy_output_equals_transformers_token_for_token(engine, trained_reference):
    assert engine.model_config.tie_word_embeddings and engine.model_config.num_layers == 30
    results = engine.generate(trained_reference.prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [r.token_ids for r in results] == trained_reference.expected
    assert [r.text for r in results] == trained_reference.texts
    assert engine.check_integrity()


def test_the_answers_make_sense(trained_reference):
    # 135M parameters at 4 bits: right about Paris and colours, wrong about spiders' legs and 12 + 30.
    assert trained_reference.texts[0] == "The capital of France is Paris."
    assert trained_reference.texts[2] == "The primary colors are: Red, Blue, and Yellow."
    ends = [ids[-1] in trained_reference.eos_token_ids for ids in trained_reference.expected]
    assert 2 <= sum(ends) < len(ends)  # some answers end at EOS, some are cut at MAX_TOKENS


@pytest.mark.parametrize(("messages", "add_generation_prompt"), TEMPLATE_CASES)
def test_chat_template_renders_as_transformers(trained_checkpoint, messages, add_generation_prompt):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(trained_checkpoint)
    ours = Tokenizer.from_pretrained(trained_checkpoint)
    text = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == text
    assert ours.encode_chat(messages, add_generation_prompt) == theirs(text, add_special_tokens=False)["input_ids"]


def test_chat_prompts_are_the_ids_transformers_makes(engine, trained_reference):
    assert [engine.tokenizer.encode_chat(c) for c in trained_reference.conversations] == trained_reference.prompts
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) put each digit in a token of its own.
    assert [engine.tokenizer.decode([i]) for i in engine.tokenizer.encode("in 2025")] == ["in", " ", "2", "0", "2", "5"]
