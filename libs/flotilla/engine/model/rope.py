"""Rotary position embedding with a cos/sin cache, computed exactly as transformers does."""

from __future__ import annotations

import math

import torch
from torch import nn

from flotilla.engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """inv_freq [head_dim / 2] in float32, with HF's "linear" or "llama3" scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3(inv_freq, scaling)


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
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos_sin_cache", self._build(None), persistent=False)

    def _build(self, device: torch.device | None) -> torch.Tensor:
        inv_freq = inverse_frequencies(self.config, device)
        positions = torch.arange(self.config.max_model_len, dtype=torch.int64, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos(), emb.sin()))  # [2, max_model_len, head_dim]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.cos_sin_cache = self._build(self.cos_sin_cache.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, H_kv, D] rotated for their token positions [T]."""
        cos_sin = self.cos_sin_cache[:, positions].to(q.dtype).unsqueeze(2)  # [2, T, 1, D]
        cos, sin = cos_sin[0], cos_sin[1]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
