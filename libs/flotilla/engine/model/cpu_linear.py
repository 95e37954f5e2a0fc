"""Linear layers with their weights packed once at load: float32 matmuls on a CPU, through the engine's own
matmul ("panel", model/panel_gemm.py: the default where its C kernel builds) or oneDNN ("onednn").

Why not F.linear: torch's CPU wheel sends `F.linear` to MKL's sgemm. On an AMD EPYC with AVX-512 (this project's VM since
2026-12-04) MKL ran at ~200 GFLOP/s where oneDNN, which ships inside the same wheel as `torch.ops.mkldnn`, ran
400-500 GFLOP/s at prefill shapes, 2-3x MKL at 64-row decode shapes and 3.8x on SmolLM2's 49,152-row lm_head
for one row (docs/performance.md, "oneDNN linears"). vLLM's CPU build calls oneDNN too. Packing reorders
each weight into oneDNN's blocked layout once, instead of on every call. The panel matmul runs as fast per core
and without oneDNN's OpenMP wake-up per call (docs/performance.md, "The engine's own matmul").

The packed weight replaces the dense one; a tied lm_head keeps the embedding (the lookup needs it) and adds
a packed copy of it (vocabulary x hidden x 4 bytes). Results differ from MKL's by float32 rounding only (the
sums run in another order): ~3e-6 relative, as between any two GEMM libraries.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from flotilla.engine.model import panel_gemm

BACKENDS = ("auto", "panel", "onednn", "torch")
# Batch size oneDNN picks its packed layout for; measured the same or better than 1 or 2,048 at 1-2,048 rows.
_PACKING_BATCH_HINT = 64


class PackedLinear(nn.Module):
    """nn.Linear's forward with its weight in oneDNN's packed layout (an opaque tensor, kept out of the module's
    parameters and state dict: nothing but this forward can read it)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACKING_BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# oneDNN keeps every primitive it creates (one per matmul shape: rows x in x out) in two caches, ideep's and its
# own, each holding 1,024 by default. For fewer than ~1,000 rows a matmul primitive owns a scratch buffer of about
# rows x out x 4 bytes, so a server, whose steps come in every row count, grew by hundreds of MiB as the caches filled
# (tiny model, 2,000 short requests: 496 -> 785 MiB RSS and still growing; small: ~9 MiB per 500-row shape of
# its 4,608-wide gate/up). Both read their capacity from the environment when oneDNN creates its first primitive.
PRIMITIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_primitive_caches(capacity: int) -> None:
    """Caps both of oneDNN's primitive caches at `capacity` shapes each, for the rest of the process. Takes effect
    only where oneDNN has created no primitive yet in this process (the engine calls it first thing); a shape
    evicted and met again is created again, ~0.3-0.7 ms. The environment is left as it was, so child processes
    (vLLM in the benchmarks) keep oneDNN's defaults."""
    if capacity < 1:
        raise ValueError(f"a primitive cache holds at least one shape, got {capacity}")
    saved = {variable: os.environ.get(variable) for variable in PRIMITIVE_CACHE_VARIABLES}
    os.environ.update({variable: str(capacity) for variable in PRIMITIVE_CACHE_VARIABLES})
    try:
        onednn_works()  # creates the process's first primitives: both caches read their capacity now
    finally:
        for variable, value in saved.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend the engine's linears use: "panel" or "onednn" (packed) or "torch" (F.linear). "auto" is panel
    for float32 on a CPU where its kernel builds, else onednn where this torch build's oneDNN works, and torch
    everywhere else (GPUs: cuBLAS)."""
    if name not in BACKENDS:
        raise ValueError(f"cpu_linear_backend must be one of {BACKENDS}, got {name!r}")
    applies = device.type == "cpu" and dtype == torch.float32
    if name in ("panel", "onednn") and not applies:
        raise ValueError(f"cpu_linear_backend {name!r} packs float32 weights on a cpu, not {dtype} on {device.type}")
    if name == "torch" or not applies:
        return "torch"
    if name in ("auto", "panel") and panel_gemm.load() is not None:
        return "panel"
    if name == "panel":
        raise ValueError("cpu_linear_backend 'panel': its C kernel could not be built (see the log)")
    if not onednn_works():
        if name == "onednn":
            raise ValueError("cpu_linear_backend 'onednn': this torch build's oneDNN linear is missing or wrong")
        return "torch"
    return "onednn"


def onednn_works() -> bool:
    """One small packed matmul against F.linear: the ops are private to torch, so check they exist and agree."""
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(5, 24, generator=generator)
        linear = nn.Linear(24, 40, bias=True)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(40, 24, generator=generator))
            linear.bias.copy_(torch.randn(40, generator=generator))
            return torch.allclose(PackedLinear(linear)(x), linear(x), rtol=1e-4, atol=1e-4)
    except (AttributeError, RuntimeError):
        return False


def pack_linears(model: nn.Module, backend: str = "onednn") -> int:
    """Replaces every nn.Linear of `model` by a PackedLinear ("onednn") or a PanelLinear ("panel"), in place;
    returns how many. With "panel", the linear a module names as its `silu_mul_input` (a Llama MLP's gate/up) is
    packed gated: it returns SiLU(gate) * up (model/panel_gemm.py)."""
    if backend not in ("onednn", "panel"):
        raise ValueError(f"pack_linears packs for 'onednn' or 'panel', not {backend!r}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if backend == "onednn":
                setattr(parent, name, PackedLinear(child))
            else:
                gated = getattr(parent, "silu_mul_input", None) == name and child.bias is None
                setattr(parent, name, panel_gemm.PanelLinear(child, gated))
            replaced += 1
    return replaced
