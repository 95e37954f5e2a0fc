"""Rotary position embedding with a cos/sin cache, computed exactly as transformers does.

Dynamic NTK and LongRoPE depend on the sequence length of the forward pass in transformers, so what a token
gets depends on how the sequence is fed. The engine follows `generate` for the request (the rope lengths of
SeqChunk.num_prompt_tokens): equal to it however the prompt is chunked, preempted or served from the prefix
cache (keyed by prompt_length_key). Where it still differs from `generate`:
- transformers' Phi-3 drops its cache at the step where a sequence first passes
  original_max_position_embeddings and recomputes every token with the long factors; the engine keeps the
  short-factor K/V of the tokens before (log-probabilities after the switch ~0.03 off on the test checkpoint);
- a batched `generate` takes one length, the longest sequence's, for the whole batch;
- transformers' dynamic RoPE keeps a grown base across calls until a call shorter than max_position_embeddings
  resets it; a served request always starts from the plain base.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flotilla.engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, device: torch.device | None = None, long: bool = False) -> torch.Tensor:
    """inv_freq [rotary_dim / 2] in float32 with HF's scaling applied; `long`: LongRoPE's long factors.
    Dynamic NTK: the frequencies of sequences up to max_position_embeddings (see dynamic_inverse_frequencies)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float) / dim
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (factors * config.rope_theta**exponents)
    if scaling is not None and scaling["rope_type"] == "yarn":
        return _yarn(config, device)
    if scaling is not None and scaling["rope_type"] == "dynamic":
        return 1.0 / (_dynamic_base(config, scaling["max_position_embeddings"]) ** exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3(inv_freq, scaling)


def dynamic_inverse_frequencies(config: ModelConfig, rope_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK's inv_freq [T, rotary_dim / 2] for sequences of rope_lens [T] (int64) tokens, computed as
    transformers' _compute_dynamic_ntk_parameters does when a forward pass grows past max_position_embeddings
    (there seq_len is a 0-d int64 tensor, so the base is a float32 tensor)."""
    scaling = config.rope_scaling
    factor, max_positions = scaling["factor"], scaling["max_position_embeddings"]
    dim = config.rotary_dim
    seq_len = rope_lens.clamp(min=max_positions)  # no host-to-device copy: it would wait for a running step
    base = config.rope_theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=rope_lens.device).to(torch.float) / dim
    return 1.0 / (base[:, None] ** exponents)


def _dynamic_base(config: ModelConfig, seq_len: int) -> float:
    """The NTK base for a Python int seq_len (transformers' initial frequencies): plain floats."""
    factor, max_positions = config.rope_scaling["factor"], config.rope_scaling["max_position_embeddings"]
    dim = config.rotary_dim
    seq_len = max(seq_len, max_positions)
    return config.rope_theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))


def attention_scaling(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (LongRoPE's and YaRN's; 1 for the other types)."""
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type")
    if rope_type == "yarn":
        return _yarn_attention_factor(scaling)
    if rope_type != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(scaling: dict) -> float:
    """transformers' _compute_yarn_parameters: attention_factor, else from factor (and mscale / mscale_all_dim)."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn(config: ModelConfig, device: torch.device | None) -> torch.Tensor:
    """Mirror of transformers' _compute_yarn_parameters' frequencies, operation for operation."""
    scaling = config.rope_scaling
    base, dim, factor = config.rope_theta, config.rotary_dim, scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Mirror of transformers' _compute_llama3_parameters, operation for operation."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def prompt_length_key(config: ModelConfig, num_prompt_tokens: int) -> str | None:
    """What a request's K/V depend on besides its tokens: under length-dependent RoPE the rope lengths of its
    prompt tokens are the prompt's length (SeqChunk.num_prompt_tokens), so prefix-cache hits must not cross
    prompts that rotate differently. None when nothing: every token's rotation follows from its position."""
    keys = []
    for scaling in (config.rope_scaling, config.sliding_rope_scaling):
        rope_type = (scaling or {}).get("rope_type")
        if rope_type == "longrope" and num_prompt_tokens > scaling["original_max_position_embeddings"]:
            keys.append("longrope:long")  # every token takes the long factors; shorter prompts, short ones
        elif rope_type == "dynamic" and num_prompt_tokens > scaling["max_position_embeddings"]:
            keys.append(f"dynamic:{num_prompt_tokens}")  # the prompt's length sets the NTK base
    return "/".join(keys) or None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin for positions 0..max_model_len-1, kept in float32 on the module's device.

    The cache is a non-persistent buffer rebuilt after every `.to()`/`to_empty()`, so it always
    follows the model's device and never degrades to the model's (bfloat16) dtype.

    Length-dependent types pick their frequencies by a token's rope length (AttentionMetadata.rope_lens: the
    length of the sequence in the forward pass transformers would compute that token in). LongRoPE keeps a
    second table (rows max_model_len..) with the long factors, used past original_max_position_embeddings.
    Dynamic NTK computes the frequencies of rope lengths past max_position_embeddings on the fly, in one
    vectorised pass per step; the table serves the shorter ones. K/V already cached keep theirs, as in HF.
    Partial rotary (rotary_dim < head_dim) rotates the first rotary_dim dims and passes the rest.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        scaling = config.rope_scaling or {}
        rope_type = scaling.get("rope_type")
        self.long_after = scaling["original_max_position_embeddings"] if rope_type == "longrope" else None
        self.dynamic_after = scaling["max_position_embeddings"] if rope_type == "dynamic" else None
        self.register_buffer("cos_sin_cache", self._build(None), persistent=False)

    def _build(self, device: torch.device | None) -> torch.Tensor:
        tables = [self._table(inverse_frequencies(self.config, device), device)]
        if self.long_after is not None:
            tables.append(self._table(inverse_frequencies(self.config, device, long=True), device))
        return torch.cat(tables, dim=1)  # [2, max_model_len (x2 for LongRoPE), rotary_dim]

    def _table(self, inv_freq: torch.Tensor, device: torch.device | None) -> torch.Tensor:
        positions = torch.arange(self.config.max_model_len, dtype=torch.int64, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_scaling(self.config)
        return torch.stack((emb.cos() * scale, emb.sin() * scale))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.cos_sin_cache = self._build(self.cos_sin_cache.device)
        return self

    def cos_sin(
        self, positions: torch.Tensor, rope_lens: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
        max_rope_len: int | None = None,
    ) -> torch.Tensor:
        """[2, T, 1, rotary_dim] in `dtype` for token positions [T]; rope_lens [T] (length-dependent types only);
        max_rope_len: their maximum, known on the host (dynamic NTK skips its pass when none is past the table)."""
        rows = positions
        if (self.long_after is not None or self.dynamic_after is not None) and rope_lens is None:
            raise ValueError(f"{self.config.rope_scaling['rope_type']} RoPE needs the rope lengths of the step")
        if self.long_after is not None:
            rows = positions + self.config.max_model_len * (rope_lens > self.long_after)
        cos_sin = self.cos_sin_cache[:, rows]
        if self.dynamic_after is not None and (max_rope_len is None or max_rope_len > self.dynamic_after):
            cos_sin = torch.where((rope_lens > self.dynamic_after)[None, :, None], self._dynamic(positions, rope_lens),
                                  cos_sin)
        return cos_sin.to(dtype).unsqueeze(2)

    def _dynamic(self, positions: torch.Tensor, rope_lens: torch.Tensor) -> torch.Tensor:
        """transformers' forward with the grown inv_freq: position * inv_freq, cos and sin (scaling 1)."""
        freqs = positions[:, None].float() * dynamic_inverse_frequencies(self.config, rope_lens)
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos(), emb.sin()))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rope_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, H_kv, D] rotated for their token positions [T] (rope_lens: see cos_sin)."""
        cos_sin = self.cos_sin(positions, rope_lens, q.dtype)
        return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos_sin [2, T, 1, rotary_dim] (from RotaryEmbedding.cos_sin, in x's dtype)."""
    cos, sin = cos_sin[0], cos_sin[1]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
