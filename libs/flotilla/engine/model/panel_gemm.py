"""Float32 linears on a CPU through the engine's own matmul (csrc/panel_gemm.c) and its thread pool
(csrc/spin_pool.h), with each weight packed once into panels of 32 output columns.

Why not oneDNN: per core it runs these matmuls no faster, but every call opens an OpenMP region, and under
OMP_WAIT_POLICY=PASSIVE (which the `flotilla` command sets: spinning OpenMP threads on shared cores made steps
several times slower) waking its second thread costs ~70 us a call, as long as a tiny model's decode-step matmul
itself. The pool's workers spin for SPIN_NS after each matmul, so the next one of the same step finds them awake,
and sleep once the step is over. A row's result does not depend on the rows beside it (each row's sums run in the
same order at every batch size), as with oneDNN. Weights take the memory of the dense ones (out_features rounded
up to 32); the dense weight is dropped, a tied lm_head keeps the embedding it shares.

A Llama MLP's gate/up linear is packed `gated`: its tiles hold gate and up columns side by side and are stored as
SiLU(gate) * up, so the [rows, 2I] product is never written and read back for a separate SiLU pass.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from flotilla.engine.model.kernel_build import KernelLibrary

CFLAGS = ["-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-Wno-psabi"]
# How long a worker spins for the next task before it sleeps: longer than the gaps inside a decode step (Python
# and element-wise kernels between two matmuls or a matmul and decode attention, ~10-40 us), short against the time
# between steps and against prefill attention, which runs on OpenMP's threads while the pool's worker spins its last
# SPIN_NS on the same cores.
SPIN_NS = 50_000

_ptr, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(library: ctypes.CDLL) -> None:
    library.panel_gemm_packed_floats.restype = _i64
    library.panel_gemm_packed_floats.argtypes = [_i64, _i64, _int]
    library.panel_gemm_pack_f32.restype = None
    library.panel_gemm_pack_f32.argtypes = [_ptr, _i64, _i64, _int, _ptr]
    library.panel_gemm_f32.restype = None
    library.panel_gemm_f32.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int, _i64]


_library = KernelLibrary("panel_gemm.c", CFLAGS, _declare)


def load() -> ctypes.CDLL | None:
    return _library.load()


def pack(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """weight [out, in] (float32, cpu) in panels of 32 output columns, for `matmul`. Gated: weight is [2I, in],
    the gate's rows then the up's."""
    library = _required()
    weight = weight.detach().contiguous()
    rows, in_features = weight.shape
    if gated and rows % 2:
        raise ValueError(f"a gated weight stacks gate and up rows: an even row count, got {rows}")
    packed = torch.empty(library.panel_gemm_packed_floats(rows, in_features, gated), dtype=torch.float32)
    library.panel_gemm_pack_f32(weight.data_ptr(), rows, in_features, gated, packed.data_ptr())
    return packed


def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           gated: bool = False) -> torch.Tensor:
    """x [..., in] @ weight.T + bias, with `packed` from `pack(weight)`; gated (`pack(weight, gated=True)`, no
    bias): SiLU(x @ gate.T) * (x @ up.T), out_features = I."""
    library = _required()
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if rows.dtype != torch.float32 or rows.device.type != "cpu":
        raise ValueError(f"panel matmul takes float32 cpu rows, got {rows.dtype} on {rows.device}")
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0]:
        library.panel_gemm_f32(rows.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                               out.data_ptr(), rows.shape[0], out_features, in_features, gated,
                               torch.get_num_threads(), SPIN_NS)
    return out.reshape(*x.shape[:-1], out_features)


def pool_run_address() -> int | None:
    """The address of the pool's C entry point (panel_gemm_pool_run), for kernels that share its threads; None
    where the library is not available."""
    library = load()
    return None if library is None else ctypes.cast(library.panel_gemm_pool_run, ctypes.c_void_p).value


def _required() -> ctypes.CDLL:
    library = load()
    if library is None:
        raise RuntimeError("the panel matmul kernel is not available (no C compiler, or FLOTILLA_DISABLE_KERNELS)")
    return library


class PanelLinear(nn.Module):
    """nn.Linear's forward through `matmul`, its weight packed (kept out of the module's parameters and state
    dict: nothing but this forward reads it). Gated (a gate/up linear without bias, `applies_silu_mul`): the
    forward returns SiLU(gate) * up, half the linear's width."""

    def __init__(self, linear: nn.Linear, gated: bool = False) -> None:
        super().__init__()
        if gated and linear.bias is not None:
            raise ValueError("a gated panel linear has no bias")
        self.in_features = linear.in_features
        self.out_features = linear.out_features // 2 if gated else linear.out_features
        self.applies_silu_mul = gated
        self.packed_weight = pack(linear.weight, gated)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.packed_weight, self.bias, self.out_features, self.applies_silu_mul)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                f"{', silu_mul' if self.applies_silu_mul else ''}")
