"""write_checkpoint: deterministic files, loadable by transformers for all three architectures."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flotilla.models import checkpoint as ckpt
from flotilla.models import toy_tokenizer, write_checkpoint

from tests.support.checkpoints import make_checkpoint

ARCHS = ("llama", "qwen2", "mistral")


def file_hashes(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_arguments_give_byte_identical_files(tmp_path_factory, checkpoint_factory):
    first = checkpoint_factory(seed=0)
    second = make_checkpoint(tmp_path_factory, seed=0)
    assert file_hashes(first) == file_hashes(second)
    assert set(file_hashes(first)) == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_other_seed_changes_only_the_weights(checkpoint_factory):
    seed0, seed1 = file_hashes(checkpoint_factory(seed=0)), file_hashes(checkpoint_factory(seed=1))
    assert seed0["model.safetensors"] != seed1["model.safetensors"]
    assert {k: v for k, v in seed0.items() if k != "model.safetensors"} == {
        k: v for k, v in seed1.items() if k != "model.safetensors"}


def test_tokenizer_is_the_same_with_and_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOTILLA_CACHE", str(tmp_path / "cache"))
    fresh = toy_tokenizer.toy_tokenizer_json(8192)
    cached_files = list((tmp_path / "cache").rglob("*.json"))
    assert len(cached_files) == 1
    assert toy_tokenizer.toy_tokenizer_json(8192) == fresh
    # A corrupted entry under the right key would be served: the key must cover what training reads.
    texts = toy_tokenizer.corpus_texts()
    assert cached_files[0].name == f"bpe-8192-{toy_tokenizer.corpus_fingerprint(texts, 8192)}.json"
    assert toy_tokenizer.corpus_fingerprint(texts, 8192) != toy_tokenizer.corpus_fingerprint(texts, 16384)
    assert toy_tokenizer.corpus_fingerprint(texts, 8192) != toy_tokenizer.corpus_fingerprint(texts[:-1], 8192)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_describes_the_architecture(checkpoint_factory, arch):
    path = checkpoint_factory(architecture=arch)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ckpt.ARCHITECTURES[arch]]
    assert config["model_type"] == arch
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (256, 4, 8192)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert config["max_position_embeddings"] == 2048
    assert config["torch_dtype"] == "float32"
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": [2, 0]}
    weights = load_file(path / "model.safetensors")
    assert ("model.layers.0.self_attn.q_proj.bias" in weights) == (arch == "qwen2")
    assert "lm_head.weight" not in weights  # tied by default


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_weight_and_greedy_output_varies(checkpoint_factory, arch):
    path = checkpoint_factory(architecture=arch)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == ckpt.ARCHITECTURES[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = load_file(path / "model.safetensors")
    assert torch.equal(model.state_dict()["model.layers.1.mlp.down_proj.weight"],
                       stored["model.layers.1.mlp.down_proj.weight"])
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                   do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    # Large init std: greedy output keeps changing with the context. At std 0.02 it repeats one token.
    assert len(set(generated)) >= 4, generated


def test_untied_bf16_checkpoint_with_rope_scaling(tmp_path_factory):
    rope = {"rope_type": "linear", "factor": 2.0}
    path = make_checkpoint(tmp_path_factory, tie_word_embeddings=False, dtype="bfloat16", rope_scaling=rope)
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["rope_scaling"] == rope
    assert config["torch_dtype"] == "bfloat16"
    weights = load_file(path / "model.safetensors")
    assert weights["lm_head.weight"].shape == (8192, 256)
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"]
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_weights_have_the_requested_spread():
    spec = ckpt.make_spec("tiny", 3, "qwen2", 0.25, True, None, "float32")
    weights = ckpt.random_weights(spec)
    assert abs(weights["model.layers.0.mlp.up_proj.weight"].std().item() - 0.25) < 0.01
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.05 and norm.std().item() > 0.05


def test_small_size_is_about_100m_parameters():
    spec = ckpt.make_spec("small", 0, "llama", 0.25, True, None, "float32")
    assert 90e6 < ckpt.num_parameters(spec) < 110e6
    assert spec.shape.hidden_size == 768 and spec.shape.num_hidden_layers == 12


@pytest.mark.parametrize("kwargs", [
    {"size": "huge"}, {"architecture": "gpt2"}, {"dtype": "int8"}, {"init_std": 0.0}, {"seed": -1},
    {"rope_scaling": "linear"},
])
def test_rejects_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        write_checkpoint(tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())
