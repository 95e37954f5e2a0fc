import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from flotilla.engine.model import ModelConfig
from flotilla.engine.model.rope import (
    RotaryEmbedding,
    attention_scaling,
    dynamic_inverse_frequencies,
    inverse_frequencies,
    prompt_length_key,
)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 50000.0}


def hf_and_ours(rope_parameters):
    hf_config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                                         rope_parameters=dict(rope_parameters))
    ours = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    return hf_config, ours


@pytest.mark.parametrize("rope_parameters", [LLAMA3, {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}])
def test_scaled_inverse_frequencies_equal_transformers(rope_parameters):
    hf_config, ours = hf_and_ours(rope_parameters)
    expected, scaling = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf_config, None)
    assert scaling == 1.0
    assert torch.equal(inverse_frequencies(ours), expected)
    _, plain = hf_and_ours({"rope_type": "default", "rope_theta": rope_parameters["rope_theta"]})
    assert not torch.equal(inverse_frequencies(plain), expected)  # the scaling really changed something


def test_cos_sin_cache_stays_float32_and_follows_moves():
    _, ours = hf_and_ours(LLAMA3)
    rope = RotaryEmbedding(ours).to(torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.float32
    assert rope.cos_sin_cache.shape == (2, 512, 64)
    positions = torch.tensor([0, 5, 511])
    q = torch.randn(3, 4, 64)
    k = torch.randn(3, 2, 64)
    q_rot, k_rot = rope(positions, q, k)
    assert torch.equal(q_rot[0], q[0]) and torch.equal(k_rot[0], k[0])  # position 0 is the identity
    assert not torch.allclose(q_rot[1], q[1])


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}


@pytest.mark.parametrize("extra", [
    {},
    {"beta_fast": 16, "beta_slow": 2},
    {"truncate": False},
    {"mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek's pair
    {"attention_factor": 1.3},
])
def test_yarn_frequencies_and_attention_factor_equal_transformers(extra):
    hf_config, ours = hf_and_ours({**YARN, **extra})
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, None)
    assert ours.rope_scaling["rope_type"] == "yarn" and ours.max_model_len == 512  # 128 * 4
    assert torch.equal(inverse_frequencies(ours), expected)
    assert attention_scaling(ours) == attention_factor and attention_factor != 1.0


def test_yarn_cos_sin_carry_the_attention_factor():
    _, ours = hf_and_ours(YARN)
    cos = RotaryEmbedding(ours).cos_sin_cache[0]
    torch.testing.assert_close(cos[0], torch.full((64,), attention_scaling(ours)))  # position 0: cos 1 * factor


def test_dynamic_ntk_frequencies_equal_transformers_at_every_length():
    hf_config, ours = hf_and_ours({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    assert ours.rope_scaling == {"rope_type": "dynamic", "factor": 4.0, "max_position_embeddings": 512}
    assert ours.max_model_len == 2048
    initial, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, None)
    assert torch.equal(inverse_frequencies(ours), initial)  # up to max_position_embeddings: plain RoPE
    lengths = torch.tensor([1, 512, 513, 700, 2048])
    ours_by_length = dynamic_inverse_frequencies(ours, lengths)
    for row, length in enumerate(lengths):
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, None, seq_len=length)  # a 0-d tensor, as in HF
        assert torch.equal(ours_by_length[row], expected)
    assert not torch.allclose(ours_by_length[3], initial)


def test_dynamic_rotation_follows_the_rope_length_not_the_position():
    _, ours = hf_and_ours({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    rope = RotaryEmbedding(ours)
    positions = torch.tensor([5, 5, 5])
    cos_sin = rope.cos_sin(positions, torch.tensor([6, 512, 600]), max_rope_len=600)
    assert torch.equal(cos_sin[:, 0], cos_sin[:, 1]) and torch.equal(cos_sin[:, 0], rope.cos_sin_cache[:, 5, None])
    assert not torch.allclose(cos_sin[:, 2], cos_sin[:, 0])
    with pytest.raises(ValueError, match="rope lengths"):
        rope.cos_sin(positions)


@pytest.mark.parametrize(("rope_parameters", "keys"), [
    ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}, [None, None, "dynamic:513", "dynamic:600"]),
    (LLAMA3, [None, None, None, None]),  # llama3 rotates by position alone
])
def test_prompt_length_key_names_what_the_kv_depend_on(rope_parameters, keys):
    _, ours = hf_and_ours(rope_parameters)
    assert [prompt_length_key(ours, n) for n in (1, 512, 513, 600)] == keys
