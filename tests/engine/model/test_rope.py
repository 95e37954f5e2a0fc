import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from flotilla.engine.model import ModelConfig
from flotilla.engine.model.rope import RotaryEmbedding, inverse_frequencies

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
