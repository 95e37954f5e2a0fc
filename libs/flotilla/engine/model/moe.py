"""Sparse mixture-of-experts MLP (Qwen3-MoE layout): softmax router, top-k experts per token.

Tokens are grouped by expert (one stable sort of the token-expert pairs) and each expert that received any
runs once over all of its tokens. Outputs are added in expert order, as transformers adds them, so the sums match
it to rounding. Two ways to run the groups:
- torch._grouped_mm, one call a projection with the groups' ends as a tensor. On CUDA in bf16 (sm90+) nothing is
  read back, so a step has no host sync in its MoE layers; on a CPU PyTorch loops over the groups itself, bit for bit
  the Python loop's result and 2-13% faster at Qwen3-30B-A3B's shapes (loadtest/bench_moe_experts.py);
- a Python loop over the experts hit, slicing by counts read back to the host, where the grouped call would be
  slow or refused (CUDA before sm90 or not in bf16, rows not 16-byte aligned).
The engine settles the way once at start-up (settle_experts_way): grouped only where it fits and a probe of it
agrees with the loop, so a device where the grouped call fails runs the loop instead of failing every step.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model.config import MoEConfig

log = logging.getLogger(__name__)

# The start-up probe's tokens, and how far the two ways may differ relative to the largest output: bf16 matmuls
# that sum in another order differ by a few units of its last place; a wrong layout differs by the whole output.
PROBE_TOKENS = 16
PROBE_TOLERANCE = 0.05


class Experts(nn.Module):
    """All experts' weights in two tensors: gate_up_proj [E, 2 * I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        inter = moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, inter))

    # None: grouped where grouped_mm_fits; True/False: the way settle_experts_way chose, or a test forces
    grouped: bool | None = None

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> sum over each token's k experts of weight * expert(x)."""
        grouped = self.grouped
        if grouped is None:
            grouped = grouped_mm_fits(x.device, x.dtype, self.gate_up_proj.shape[2], self.down_proj.shape[2])
        return (self._grouped if grouped else self._loop)(x, expert_ids, weights)

    def _grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every token-expert pair in one grouped matmul per projection, the groups' ends computed on the device."""
        top_k, num_experts = expert_ids.shape[1], self.gate_up_proj.shape[0]
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        # Pairs up to expert e's group end: a search over the sorted ids (bincount would read its max back on CUDA).
        experts = torch.arange(num_experts, device=x.device, dtype=flat_ids.dtype)
        ends = torch.searchsorted(flat_ids[order], experts, right=True).to(torch.int32)
        tokens = order // top_k
        # W [E, out, in] transposed is the column-major [E, in, out] the grouped kernel wants: x @ W^T per group.
        gate, up = torch._grouped_mm(x[tokens], self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        hidden = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, hidden * weights.flatten()[order, None])
        return out

    def _loop(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
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


def grouped_mm_fits(device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> bool:
    """Whether the experts run grouped: rows 16-byte aligned (the grouped call refuses others), and on CUDA only its
    fast path, sm90+ in bf16 (its fallback there reads group sizes back, as the Python loop does)."""
    aligned = all(size * dtype.itemsize % 16 == 0 for size in (hidden_size, intermediate_size))
    if not (aligned and hasattr(torch, "_grouped_mm")):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def expert_layers(model: nn.Module) -> list[Experts]:
    """The model's MoE layers' experts, first layer first."""
    return [module for module in model.modules() if isinstance(module, Experts)]


def random_routing(num_tokens: int, hidden_size: int, num_experts: int, top_k: int, device: torch.device,
                   dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens x [T, H] in `dtype`, each sent to top_k of its own experts (uniform scores) with renormalised
    weights: the start-up probe's inputs, and the device check's."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden_size, generator=generator, device=device).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=generator, device=device)
    weights, expert_ids = scores.topk(top_k, dim=-1)
    return x, expert_ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def settle_experts_way(model: nn.Module) -> bool:
    """At start-up: whether the model's MoE layers run grouped, set on each of them. Where grouped_mm_fits, the first
    layer's experts run a probe both ways (random tokens, each to its own experts); an error or a difference past
    PROBE_TOLERANCE sends every layer to the loop, with a warning. Returns the way: True for grouped."""
    layers = expert_layers(model)
    if not layers:
        return False
    first = layers[0]
    weight = first.gate_up_proj
    grouped = grouped_mm_fits(weight.device, weight.dtype, weight.shape[2], first.down_proj.shape[2])
    if grouped:
        try:
            difference = _probe(first)
        except RuntimeError as error:
            log.warning("MoE experts: the grouped matmul failed on %s (%s); every layer runs the loop",
                        weight.device, error)
            grouped = False
        else:
            if difference > PROBE_TOLERANCE:
                log.warning("MoE experts: the grouped matmul differs from the loop by %.3g of the output on %s; "
                            "every layer runs the loop", difference, weight.device)
                grouped = False
    for layer in layers:
        layer.grouped = grouped
    return grouped


@torch.inference_mode()
def _probe(experts: Experts) -> float:
    """The largest difference between the two ways over the largest output, on PROBE_TOKENS random tokens."""
    weight = experts.gate_up_proj
    num_experts = weight.shape[0]
    x, expert_ids, weights = random_routing(PROBE_TOKENS, weight.shape[2], num_experts, min(2, num_experts),
                                            weight.device, weight.dtype, seed=0)
    grouped = experts._grouped(x, expert_ids, weights).float()
    loop = experts._loop(x, expert_ids, weights).float()
    largest = loop.abs().max().item()
    return (grouped - loop).abs().max().item() / largest if largest > 0 else float((grouped != 0).any())


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
