import json

import pytest
import torch

from flotilla.engine.model import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "torch_dtype": "bfloat16",
}


def parse(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **overrides})


def test_llama_fields():
    config = parse()
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (3, 8, 2, 16)
    assert config.rope_theta == 500000.0 and config.rope_scaling is None
    assert config.max_model_len == 4096
    assert config.torch_dtype == torch.bfloat16
    assert config.bos_token_id == 1 and config.eos_token_ids == (2, 3)
    assert not config.attention_bias and not config.o_proj_bias and not config.tie_word_embeddings


def test_explicit_head_dim_wins():
    assert parse(head_dim=32).head_dim == 32


def test_kv_bytes_per_token():
    config = parse()
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 3 * 2 * 16 * 2
    assert config.kv_bytes_per_token(torch.float32) == 2 * 3 * 2 * 16 * 4


def test_qwen2_bias_on_qkv_only_and_window_off_by_default():
    config = parse(architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=False,
                   tie_word_embeddings=True)
    assert config.attention_bias and not config.o_proj_bias and config.tie_word_embeddings
    assert config.max_model_len == 4096 and config.sliding_window is None


def test_qwen3_qk_norm_bias_from_config_and_window_off_by_default():
    config = parse(architectures=["Qwen3ForCausalLM"], attention_bias=True, sliding_window=1024, head_dim=64)
    assert config.qk_norm and config.attention_bias and config.o_proj_bias and config.head_dim == 64
    assert config.sliding_window is None and not parse().qk_norm


def test_phi3_partial_rotary_and_longrope_from_transformers4_layout():
    scaling = {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    config = parse(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.75, rope_scaling=scaling,
                   original_max_position_embeddings=1024)
    assert config.rotary_dim == 12 and config.head_dim == 16
    assert config.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                                   "factor": 4.0, "original_max_position_embeddings": 1024}
    assert parse(architectures=["Phi3ForCausalLM"], rope_scaling=scaling).rope_scaling[
        "original_max_position_embeddings"] == 4096  # Phi3Config's default


def test_qwen3_moe_sparse_layers():
    config = parse(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=6, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    assert config.moe.sparse_layers == (1, 5) and config.moe.num_experts == 8 and config.moe.norm_topk_prob
    assert config.qk_norm and parse().moe is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        parse(architectures=["Qwen3MoeForCausalLM"], num_local_experts=4, num_experts_per_tok=5)


def test_mistral_sliding_window_masks_every_layer_without_capping_the_context():
    config = parse(architectures=["MistralForCausalLM"], sliding_window=1024)
    assert config.max_model_len == 4096 and config.sliding_window == 1024 and config.sliding_layers == (0, 1, 2)
    config = parse(architectures=["MistralForCausalLM"], sliding_window=None)
    assert config.sliding_window is None and config.sliding_layers == ()


def test_qwen2_window_applies_from_max_window_layers_or_layer_types():
    config = parse(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert config.sliding_window == 64 and config.sliding_layers == (1, 2) and config.max_model_len == 4096
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert parse(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=64,
                 layer_types=types).sliding_layers == (0, 2)
    assert parse(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
                 max_window_layers=3).sliding_window is None  # no layer slides


def test_transformers4_rope_scaling_layout():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = parse(rope_scaling=scaling)
    assert config.rope_scaling == scaling and config.rope_theta == 500000.0


def test_transformers5_rope_parameters_layout():
    config = parse(rope_theta=None, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0} and config.rope_theta == 1e4
    assert parse(rope_parameters={"type": "default", "rope_theta": 7.0}).rope_scaling is None


def test_llama3_without_original_max_uses_max_position_embeddings():
    config = parse(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0})
    assert config.rope_scaling["original_max_position_embeddings"] == 4096


def test_gemma2_defaults_of_a_config_without_layer_types():
    config = parse(architectures=["Gemma2ForCausalLM"], hidden_act="gelu_pytorch_tanh",
                   hidden_activation="gelu_pytorch_tanh", sliding_window=4096)
    assert config.is_gemma and config.hidden_act == "gelu_pytorch_tanh" and config.head_dim == 256
    assert config.sliding_window == 4096 and config.sliding_layers == (0, 2)  # alternating, sliding first
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)  # Gemma2Config's defaults
    assert config.attention_scale == 256**-0.5 and config.tie_word_embeddings and not config.qk_norm
    assert config.max_model_len == 4096 and config.sliding_rope_theta is None
    assert parse(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=None).attn_logit_softcap is None


def test_gemma3_transformers4_layout_local_rope_and_pattern():
    config = parse(architectures=["Gemma3ForCausalLM"], rope_theta=1e6, rope_local_base_freq=1e4,
                   rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512, sliding_window_pattern=3,
                   query_pre_attn_scalar=64, attn_logit_softcapping=50.0, final_logit_softcapping=None)
    assert config.sliding_layers == (0, 1) and config.sliding_window == 512 and config.qk_norm
    assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.sliding_rope_theta == 1e4 and config.sliding_rope_scaling is None
    assert config.attention_scale == 64**-0.5
    assert config.attn_logit_softcap is None and config.final_logit_softcap is None  # Gemma 3 never applies it


def test_gemma3_transformers5_layout_rope_per_layer_type():
    types = ["sliding_attention", "full_attention", "full_attention"]
    config = parse(architectures=["Gemma3ForCausalLM"], layer_types=types, rope_theta=None, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    assert config.sliding_layers == (0,) and config.sliding_window == 4096  # Gemma3TextConfig's default window
    assert (config.rope_theta, config.sliding_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}


def test_yarn_factor_from_lengths_and_max_model_len_stretched():
    config = parse(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 32768})
    assert config.max_model_len == 131072  # as vLLM: original * factor
    config = parse(max_position_embeddings=16384, rope_scaling={"rope_type": "yarn", "factor": None, "beta_fast": 8,
                                                                "original_max_position_embeddings": 4096})
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                   "beta_fast": 8}
    assert config.max_model_len == 16384


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "unsupported rope type"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, "needs"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "bidirectional"),
        ({"architectures": ["Gemma3ForCausalLM"], "layer_types": ["chunked_attention"] * 3}, "layer_types"),
        ({"architectures": ["Gemma2ForCausalLM"], "layer_types": ["full_attention"]}, "layer_types"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type"),
        ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}}, "unsupported rope type"),
    ],
)
def test_unsupported_configs_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse(**overrides)


def test_from_pretrained_reads_generation_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (7, 9)


def test_from_pretrained_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
