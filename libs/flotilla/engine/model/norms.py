"""RMSNorm as Llama (weight * normed, cast back first) and as Gemma (normed * (1 + weight), cast back last)."""

from __future__ import annotations

import torch
from torch import nn


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        return self.weight * _normalize(x.to(torch.float32), self.eps).to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """The weight is stored centred on 0 and the whole product runs in float32 (transformers' Gemma2RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize(x.float(), self.eps) * (1.0 + self.weight.float())).type_as(x)


def rms_norm(config, hidden_size: int) -> nn.Module:
    """The family's norm over `hidden_size` features (config: a ModelConfig)."""
    norm = GemmaRMSNorm if config.is_gemma else RMSNorm
    return norm(hidden_size, config.rms_norm_eps)
