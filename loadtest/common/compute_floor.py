"""The machine's fp32 matmul rate and the time a forward pass over the workload could not go below."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from flotilla.engine.model import cpu_linear


class ComputeFloor(NamedTuple):
    gemm_gflops: float
    num_parameters: int
    num_tokens: int  # prompt + output tokens: every one goes through every weight once
    num_output_tokens: int

    @property
    def seconds(self) -> float:
        return 2.0 * self.num_parameters * self.num_tokens / (self.gemm_gflops * 1e9)

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.seconds


def measure_gemm_gflops(device: torch.device, size: int = 2048, reps: int = 5) -> float:
    """Best of `reps` square fp32 matmuls after one warm-up, at the current torch thread count, through the
    fastest library torch has here: torch.mm (MKL on x86 CPUs, cuBLAS on GPUs) and, on a CPU, oneDNN with a
    packed weight (what the engine's linears use: flotilla.engine.model.cpu_linear), which on an AMD EPYC ran
    2x MKL. The best rep, not the mean: the floor should be what the machine can do, not what a noisy moment
    gave."""
    if size < 1 or reps < 1:
        raise ValueError(f"size and reps must be >= 1, got {size} and {reps}")
    a = torch.randn(size, size, dtype=torch.float32, device=device)
    b = torch.randn(size, size, dtype=torch.float32, device=device)
    out = torch.empty(size, size, dtype=torch.float32, device=device)
    best = _best_seconds(lambda: torch.mm(a, b, out=out), device, reps)
    if device.type == "cpu" and cpu_linear.onednn_works():
        linear = torch.nn.Linear(size, size, bias=False)
        with torch.no_grad():
            linear.weight.copy_(b)
        packed = cpu_linear.PackedLinear(linear)
        best = min(best, _best_seconds(lambda: packed(a), device, reps))
    return 2.0 * size**3 / max(best, 1e-9) / 1e9


def _best_seconds(matmul, device: torch.device, reps: int) -> float:
    matmul()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        matmul()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
