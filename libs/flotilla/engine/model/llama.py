"""Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3 layouts) over a paged KV cache.

Numerics follow transformers step for step (fp32 RMSNorm, rope cos/sin cast to the model dtype,
residual adds in the model dtype) so that greedy output matches it token for token.
q/k/v and gate/up are fused into single matmuls; the loader splits checkpoint tensors into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model.attention import AttentionMetadata, paged_attention
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.moe import SparseMoE
from flotilla.engine.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.window = config.sliding_window if index in config.sliding_layers else None
        # A plain flag: hasattr on a module raises and catches AttributeError inside nn.Module.__getattr__,
        # once per layer per step on every model without the norms.
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k, meta.seq_ends)
        out = paged_attention(q, k, v, kv_cache, meta, window=self.window)
        return self.o_proj(out.view(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, index)
        is_sparse = config.moe is not None and index in config.moe.sparse_layers
        self.mlp = SparseMoE(config.hidden_size, config.moe) if is_sparse else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.rotary_emb, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_embeddings()

    def tie_embeddings(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        layer_callback: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden states [T, hidden]; K/V go into kv_caches.
        `layer_callback(i)` runs once layer i's K/V are in the cache (KV transfer ships them layer by layer)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        x = self.model.embed_tokens(input_ids)
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(x, positions, attn_metadata, kv_cache)
            if layer_callback is not None:
                layer_callback(index)
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; the matmul runs in the model dtype, as in HF."""
        return self.lm_head(hidden_states).float()
