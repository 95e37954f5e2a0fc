"""RMSNorm as Llama (weight * normed, cast back first) and as Gemma (normed * (1 + weight), cast back last)."""

from __future__ import annotations

import torch
from torch import nn

from flotilla.engine.model import fused_ops


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps)  # one pass on the CPU, the torch ops elsewhere

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm); on the CPU the sum is written into x (fused_ops.add_rms_norm)."""
        return fused_ops.add_rms_norm(x, delta, self.weight, self.eps)


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
