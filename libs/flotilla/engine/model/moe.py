"""Sparse mixture-of-experts MLP (Qwen3-MoE layout): softmax router, top-k experts per token.

Tokens are grouped by expert (one stable sort of the token-expert pairs) and each expert that received any
runs once over all of its tokens: the Python loop is over experts, never over tokens. Outputs are added in
expert order, as transformers adds them, so the sums match it to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model.config import MoEConfig


class Experts(nn.Module):
    """All experts' weights in two tensors: gate_up_proj [E, 2 * I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        inter = moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, inter))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> sum over each token's k experts of weight * expert(x)."""
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # pair indices (token * k + slot), grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // top_k
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            hidden = F.linear(F.silu(gate) * up, self.down_proj[expert]) * flat_weights[pairs, None]
            out.index_add_(0, tokens, hidden)
        return out


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = Experts(hidden_size, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, expert_ids = torch.topk(probs, self.moe.num_experts_per_tok, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, expert_ids, weights.to(router_logits.dtype))
