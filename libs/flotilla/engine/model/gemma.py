"""Gemma 2 and Gemma 3 (text) decoders: Llama's attention and MLP (GeGLU, query_pre_attn_scalar, soft-caps and
sliding windows from the config) in Gemma's layer, with its embedding scale and (1 + weight) RMSNorms.

A layer normalises before and after both its attention and its MLP. Gemma 3 adds q/k norms and gives its
sliding layers their own RoPE (rope_local_base_freq); Gemma 2 soft-caps the attention scores. Both scale the
embeddings by sqrt(hidden_size) rounded to the embedding dtype, as transformers does.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn

from flotilla.engine.model.attention import AttentionMetadata
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from flotilla.engine.model.norms import GemmaRMSNorm
from flotilla.engine.model.rope import RotaryEmbedding


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, index)
        self.mlp = LlamaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, rotations, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotations, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.local_rotary_emb = None
        if config.sliding_rope_theta is not None:
            local = replace(config, rope_theta=config.sliding_rope_theta, rope_scaling=config.sliding_rope_scaling)
            self.local_rotary_emb = RotaryEmbedding(local)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """The RoPE tables, in the order of LlamaAttention.rope_index: the full layers', the sliding layers'."""
        local = [self.local_rotary_emb] if self.local_rotary_emb is not None else []
        return [self.rotary_emb, *local]


class GemmaForCausalLM(LlamaForCausalLM):
    model_class = GemmaModel

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * _embedding_scale(self.config.hidden_size, x.dtype)


@functools.cache
def _embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as transformers' scaled embedding multiplies it: a float32 tensor cast to the
    embedding dtype (in bfloat16, sqrt(3072) = 55.43 becomes 55.5)."""
    return torch.tensor(hidden_size**0.5).to(dtype).item()
