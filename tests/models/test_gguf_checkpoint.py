"""GGUF -> Hugging Face checkpoint conversion on small files written here with GGUFWriter: weights equal
transformers' own GGUF reader (dequantization, q/k row order) for every supported tensor type, an F32 file
gives back the checkpoint it was made from, and what is not supported fails naming what it is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from flotilla.engine.model.config import ModelConfig
from flotilla.engine.tokenizer import Tokenizer
from flotilla.models.gguf_checkpoint import SUPPORTED_TENSOR_TYPES, convert_gguf, ensure_converted
from flotilla.models.gguf_tokenizer import GGUFError

from tests.models.gguf_files import random_blocks, write_gguf

BLOCK_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_QUANT_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _transformers_tensors(gguf_path: Path, converted: Path) -> dict[str, np.ndarray]:
    """transformers' GGUF reader (as from_pretrained(gguf_file=...) uses it) for the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(converted))
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    return {name: np.asarray(tensor, dtype=np.float32) for name, tensor in parsed["tensors"].items()}


def _assert_same_tensors(ours: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert set(ours) == set(reference)
    for name in ours:
        np.testing.assert_array_equal(ours[name], reference[name], err_msg=name)  # NaNs (random K blocks) too


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_an_f32_file_converts_back_to_the_checkpoint_it_was_made_from(architecture, checkpoint_factory, tmp_path):
    original = checkpoint_factory(size="micro", seed=3, architecture=architecture)
    converted = convert_gguf(write_gguf(tmp_path / "model.gguf", original), tmp_path / "hf")
    weights = load_file(str(converted / "model.safetensors"))
    _assert_same_tensors(weights, load_file(str(original / "model.safetensors")))
    ours, theirs = ModelConfig.from_pretrained(converted), ModelConfig.from_pretrained(original)
    assert ours.__dict__ | {"eos_token_ids": ()} == theirs.__dict__ | {"eos_token_ids": ()}
    assert ours.eos_token_ids == (theirs.eos_token_ids[0],)  # the GGUF names one EOS; the original adds BOS


@pytest.mark.parametrize("tensor_type", BLOCK_TYPES)
def test_tensors_dequantize_as_transformers_reads_them(tensor_type, checkpoint_factory, tmp_path):
    original = checkpoint_factory(size="micro", seed=1, architecture="llama")
    gguf_path = write_gguf(tmp_path / "model.gguf", original, tensor_type=tensor_type)
    converted = convert_gguf(gguf_path, tmp_path / "hf")
    ours = load_file(str(converted / "model.safetensors"))
    _assert_same_tensors(ours, _transformers_tensors(gguf_path, converted))
    # Quantization error only: each weight stays near the original (std 0.25), q/k rows in place.
    for name, weight in load_file(str(original / "model.safetensors")).items():
        assert np.abs(ours[name] - weight).max() < 0.25, name


@pytest.mark.parametrize("tensor_type", K_QUANT_TYPES)
def test_k_quant_tensors_dequantize_as_transformers_reads_them(tensor_type, checkpoint_factory, tmp_path):
    # gguf cannot quantize to K types: random blocks instead; rows of 256 weights (tiny: all but ffn_down's).
    original = checkpoint_factory(size="tiny", seed=0, architecture="llama")
    gguf_path = write_gguf(tmp_path / "model.gguf", original, tensor_type=tensor_type, encode=random_blocks())
    converted = convert_gguf(gguf_path, tmp_path / "hf")
    _assert_same_tensors(load_file(str(converted / "model.safetensors")), _transformers_tensors(gguf_path, converted))


@pytest.mark.parametrize("tensor_type", ["IQ4_NL", "Q8_1"])
def test_an_unsupported_tensor_type_is_named(tensor_type, checkpoint_factory, tmp_path):
    gguf_path = write_gguf(tmp_path / "model.gguf", checkpoint_factory(size="micro", seed=0),
                           tensor_type=tensor_type, encode=random_blocks())
    with pytest.raises(GGUFError, match=rf"tensor 'token_embd.weight' has type {tensor_type}, which is not "
                                        rf"supported; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"):
        convert_gguf(gguf_path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # nothing half-written


def test_unsupported_architectures_and_rope_variants_are_named(checkpoint_factory, tmp_path):
    micro = checkpoint_factory(size="micro", seed=0)
    cases = {
        "gemma2": dict(architecture="gemma2"),
        "rope_freqs": dict(extra_tensors={"rope_freqs.weight": np.ones(4, dtype=np.float32)}),
        "yarn": dict(metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
        "tokenizer": dict(tokenizer_model="llama"),
        "pre": dict(pre_tokenizer="made-up"),
    }
    errors = {}
    for case, kwargs in cases.items():
        with pytest.raises(GGUFError) as raised:
            convert_gguf(write_gguf(tmp_path / f"{case}.gguf", micro, **kwargs), tmp_path / case)
        errors[case] = str(raised.value)
    assert errors["gemma2"] == "GGUF architecture 'gemma2' is not supported; supported: llama, qwen2"
    assert "'rope_freqs.weight'" in errors["rope_freqs"]
    assert errors["yarn"] == "GGUF RoPE scaling 'yarn' is not supported; supported: none, linear"
    assert errors["tokenizer"] == "GGUF tokenizer model 'llama' is not supported; only byte-level BPE ('gpt2')"
    assert errors["pre"].startswith("GGUF pre-tokenizer 'made-up' is not supported; supported: ")


def test_the_tokenizer_and_chat_template_come_through(checkpoint_factory, tmp_path):
    original = checkpoint_factory(size="micro", seed=0)
    converted = convert_gguf(write_gguf(tmp_path / "model.gguf", original, pre_tokenizer="qwen2"), tmp_path / "hf")
    ours, theirs = Tokenizer.from_pretrained(converted), Tokenizer.from_pretrained(original)
    texts = ["Hello world, 12345 ships!", "  two  spaces\n\nand tabs\t", "<|im_start|>user\nhi<|im_end|>", "x=1;"]
    assert [ours.encode(text) for text in texts] == [theirs.encode(text) for text in texts]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert ours.eos_token_ids == {2} and ours.bos_token_id == theirs.bos_token_id == 0  # <|im_end|>, <|endoftext|>


def test_a_converted_file_is_reused_until_it_changes(checkpoint_factory, tmp_path):
    gguf_path = write_gguf(tmp_path / "model.gguf", checkpoint_factory(size="micro", seed=0))
    announced: list[str] = []
    ensure_converted(gguf_path, tmp_path / "hf", announce=announced.append)
    weights = tmp_path / "hf" / "model.safetensors"
    first = weights.stat().st_mtime_ns
    ensure_converted(gguf_path, tmp_path / "hf", announce=announced.append)
    assert len(announced) == 1 and weights.stat().st_mtime_ns == first
    write_gguf(gguf_path, checkpoint_factory(size="micro", seed=1))  # same path, new contents
    ensure_converted(gguf_path, tmp_path / "hf", announce=announced.append)
    assert len(announced) == 2
    assert json.loads((tmp_path / "hf" / "conversion.json").read_text())["size"] == gguf_path.stat().st_size
