"""Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3 layouts) over a paged KV cache.

Numerics follow transformers step for step (fp32 RMSNorm, rope cos/sin cast to the model dtype,
residual adds in the model dtype) so that greedy output matches it token for token.
q/k/v and gate/up are fused into single matmuls; the loader splits checkpoint tensors into them.
The attention and MLP also serve Gemma 2/3 (gemma.py): their scale, sliding window, soft-cap, norm and
activation come from the config.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model import fused_ops
from flotilla.engine.model.attention import AttentionMetadata, paged_attention
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.kv_scales import UNIT, RangeRecorder
from flotilla.engine.model.moe import SparseMoE
from flotilla.engine.model.norms import RMSNorm, rms_norm
from flotilla.engine.model.rope import RotaryEmbedding, apply_rotary

_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcap
        self.window = config.sliding_window if index in config.sliding_layers else None
        self.index = index
        self.kv_scales = UNIT  # an fp8 cache's, set at start-up (engine/kv_calibration.py, model/kv_scales.py)
        self.range_recorder: RangeRecorder | None = None  # watches K/V during the scales' calibration pass
        # Which of the model's RoPE tables this layer rotates with: 1 is the sliding layers' own (Gemma 3).
        self.rope_index = int(self.window is not None and config.sliding_rope_theta is not None)
        # A plain flag: hasattr on a module raises and catches AttributeError inside nn.Module.__getattr__,
        # once per layer per step on every model without the norms.
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = rms_norm(config, config.head_dim)
            self.k_norm = rms_norm(config, config.head_dim)

    def forward(
        self, x: torch.Tensor, rotations: Sequence[torch.Tensor], meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """rotations: the model's cos/sin of this step, one per RoPE table (RotaryEmbedding.cos_sin)."""
        qkv = self.qkv_proj(x)
        cos_sin = rotations[self.rope_index]
        # On the CPU, q and k are rotated in place in one pass (fused_ops); q/k norms come before RoPE.
        rotated = not self.qk_norm and fused_ops.rope_in_place(qkv, cos_sin, self.num_heads, self.num_kv_heads,
                                                               self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotated:
            q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
        if self.range_recorder is not None:
            self.range_recorder.observe(self.index, k, v)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window, self.softcap, self.kv_scales)
        return self.o_proj(out.view(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.is_silu = config.hidden_act == "silu"
        # cpu_linear.pack_linears may swap this linear for one that applies SiLU(gate) * up itself
        self.silu_mul_input = "gate_up_proj" if self.is_silu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "applies_silu_mul", False):  # the panel matmul's gated tiles (CPU)
            return self.down_proj(self.gate_up_proj(x))
        if self.is_silu:  # one pass on the CPU (fused_ops), the torch ops elsewhere
            return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, index)
        is_sparse = config.moe is not None and index in config.moe.sparse_layers
        self.mlp = SparseMoE(config.hidden_size, config.moe) if is_sparse else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rotations, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        x, mlp_out = self.forward_residual(x, None, rotations, meta, kv_cache)
        return x + mlp_out

    def forward_residual(self, x, pending: torch.Tensor | None, rotations, meta: AttentionMetadata,
                         kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its residual adds left to the next norm: its input is x + pending (pending: the last
        layer's MLP output, or None) and it returns (its residual stream, its MLP output). On the CPU each add
        runs inside the norm that follows it and writes into x (fused_ops.add_rms_norm)."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_and_norm(x, pending)
        attended = self.self_attn(normed, rotations, meta, kv_cache)
        x, normed = self.post_attention_layernorm.add_and_norm(x, attended)
        return x, self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """The RoPE tables, in the order of LlamaAttention.rope_index."""
        return [self.rotary_emb]


class LlamaForCausalLM(nn.Module):
    model_class: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_embeddings()

    def tie_embeddings(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

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
        x = self.embed(input_ids)
        meta = attn_metadata.with_cache_rows(kv_caches[0])  # every layer writes its new K/V to the same rows
        rotations = [rope.cos_sin(positions, meta.rope_lens, x.dtype, meta.max_rope_len)
                     for rope in self.model.rotary_embeddings()]  # once per step, for every layer
        pending = None  # a Llama layer's MLP output, added to x in the next norm
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if isinstance(layer, LlamaDecoderLayer):
                x, pending = layer.forward_residual(x, pending, rotations, meta, kv_cache)
            else:
                x = layer(x if pending is None else x + pending, rotations, meta, kv_cache)
                pending = None
            if layer_callback is not None:
                layer_callback(index)
        if pending is None:
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, pending)[1]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; the matmul (and Gemma's soft-cap) in the model dtype, as in HF."""
        logits = self.lm_head(hidden_states)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
