"""Rotary position embedding with a cos/sin cache, computed exactly as transformers does."""

from __future__ import annotations

import math

import torch
from torch import nn

from flotilla.engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, device: torch.device | None = None, long: bool = False) -> torch.Tensor:
    """inv_freq [rotary_dim / 2] in float32 with HF's scaling applied; `long`: LongRoPE's long factors."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float) / dim
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (factors * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3(inv_freq, scaling)


def attention_scaling(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (LongRoPE's; 1 for the other types)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin for positions 0..max_model_len-1, kept in float32 on the module's device.

    The cache is a non-persistent buffer rebuilt after every `.to()`/`to_empty()`, so it always
    follows the model's device and never degrades to the model's (bfloat16) dtype.

    LongRoPE keeps a second table (rows max_model_len..) with the long factors. As in transformers, a
    forward pass uses them for every token of a sequence whose context after the step is longer than
    original_max_position_embeddings, and the short ones otherwise; K/V already cached keep theirs.
    Partial rotary (rotary_dim < head_dim) rotates the first rotary_dim dims and passes the rest.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        scaling = config.rope_scaling or {}
        is_longrope = scaling.get("rope_type") == "longrope"
        self.long_after = scaling["original_max_position_embeddings"] if is_longrope else None
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
        self, positions: torch.Tensor, seq_ends: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """[2, T, 1, rotary_dim] in `dtype` for token positions [T]; seq_ends [T]: the context length after the
        step of each token's sequence (LongRoPE only)."""
        rows = positions
        if self.long_after is not None:
            if seq_ends is None:
                raise ValueError("LongRoPE needs the sequence ends of the step")
            rows = positions + self.config.max_model_len * (seq_ends > self.long_after)
        return self.cos_sin_cache[:, rows].to(dtype).unsqueeze(2)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, seq_ends: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, H_kv, D] rotated for their token positions [T] (seq_ends: see cos_sin)."""
        cos_sin = self.cos_sin(positions, seq_ends, q.dtype)
        return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos_sin [2, T, 1, rotary_dim] (from RotaryEmbedding.cos_sin, in x's dtype)."""
    cos, sin = cos_sin[0], cos_sin[1]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
