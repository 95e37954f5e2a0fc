"""A Llama layer's element-wise work in one C pass each on the CPU (csrc/fused_elementwise.c): residual add +
RMSNorm, SiLU(gate) * up, RoPE on q and k in place, and the new K/V written into the cache. Where the kernel does
not apply (not a contiguous float32 CPU tensor) or cannot be built (kernel_build.py), rms_norm, add_rms_norm and
silu_mul fall back to the torch ops they replace; rope_in_place and write_rows return False and leave that to
their caller."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from flotilla.engine.model.kernel_build import KernelLibrary

# No FMA contraction: RoPE's products and sums stay those of the torch path, bit for bit.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fno-reciprocal-math",
          "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _declare(library: ctypes.CDLL) -> None:
    library.add_rms_norm_f32.restype = None
    library.add_rms_norm_f32.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int]
    library.silu_mul_f32.restype = None
    library.silu_mul_f32.argtypes = [_ptr, _ptr, _i64, _i64, _int]
    library.rope_neox_f32.restype = None
    library.rope_neox_f32.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _int]
    library.write_rows_f32.restype = _int
    library.write_rows_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _int]


_library = KernelLibrary("fused_elementwise.c", CFLAGS, _declare)


def load() -> ctypes.CDLL | None:
    return _library.load()


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: weight * (x * rsqrt(mean(x ** 2) + eps)), float32 throughout; x [..., n]."""
    library = load()
    if library is None or not _fits(x, weight) or x.dim() < 1:
        return _torch_rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    n = x.shape[-1]
    library.add_rms_norm_f32(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), x.numel() // max(n, 1), n,
                             eps, torch.get_num_threads())
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); with the kernel the sum is written into x (the residual stream, which
    the caller owns and no longer needs)."""
    library = load()
    if library is None or not _fits(x, delta, weight) or x.shape != delta.shape or x.dim() < 1:
        summed = x + delta
        return summed, _torch_rms_norm(summed, weight, eps)
    out = torch.empty_like(x)
    n = x.shape[-1]
    library.add_rms_norm_f32(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                             x.numel() // max(n, 1), n, eps, torch.get_num_threads())
    return x, out


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x = x.to(torch.float32)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(input_dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2n] (gate then up) -> silu(gate) * up [..., n]."""
    library = load()
    if library is None or not _fits(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], n))
    library.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // max(2 * n, 1), n,
                         torch.get_num_threads())
    return out


def rope_in_place(qkv: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Rotate the q and k heads of qkv [T, (H + 2 H_kv) * D] in place by cos_sin [2, T, 1, rotary_dim]
    (RotaryEmbedding.cos_sin), as apply_rotary does. False (nothing done): the kernel does not apply."""
    library = load()
    rotary_dim = cos_sin.shape[-1]
    if (library is None or not _fits(qkv, cos_sin) or qkv.dim() != 2 or rotary_dim % 2
            or rotary_dim > head_dim or cos_sin.shape[1] != qkv.shape[0]):
        return False
    library.rope_neox_f32(qkv.data_ptr(), cos_sin.data_ptr(), qkv.shape[0], qkv.shape[1], num_heads, num_kv_heads,
                          head_dim, rotary_dim, torch.get_num_threads())
    return True


def write_rows(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> bool:
    """values [T, H_kv, D] into rows `rows` [T * H_kv] (kv_cache.cache_rows) of `cache` (one layer's K or V) viewed
    as [-1, D], as `cache.view(-1, D).index_copy_(0, rows, values.reshape(-1, D))` does, reading values in place
    when each token's heads are contiguous (a slice of the fused qkv output). False (nothing done): the kernel does
    not apply. IndexError: a row outside the cache (nothing written)."""
    library = load()
    if (library is None or not _fits(cache) or values.dim() != 3 or values.dtype != torch.float32
            or values.device.type != "cpu" or rows.device.type != "cpu" or rows.dtype != torch.int64
            or not rows.is_contiguous()):
        return False
    num_tokens, num_kv_heads, head_dim = values.shape
    if (values.stride(-1) != 1 or values.stride(-2) != head_dim or cache.shape[-1] != head_dim
            or rows.numel() != num_tokens * num_kv_heads):
        return False
    status = library.write_rows_f32(values.data_ptr(), values.stride(0), rows.data_ptr(), cache.data_ptr(),
                                    cache.numel() // head_dim, num_tokens, num_kv_heads, head_dim,
                                    torch.get_num_threads())
    if status != 0:
        raise IndexError(f"a K/V row outside the cache's {cache.numel() // head_dim} rows")
    return True
