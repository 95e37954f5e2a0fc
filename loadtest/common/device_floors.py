"""What a device can do at best, for the GPU check's floors: memory bandwidth (a large device-to-device copy,
bytes read + written) and the 16-bit matmul rate (square torch.mm). Best of a few timed reps after a warm-up,
timed with CUDA events on a GPU, the wall clock elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed_seconds(run: Callable[[], None], device: torch.device, reps: int) -> list[float]:
    """Seconds of each of `reps` runs after one warm-up: CUDA events on a GPU, the wall clock elsewhere."""
    run()
    seconds = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
    return seconds


def _best_seconds(run: Callable[[], None], device: torch.device, reps: int) -> float:
    return max(min(timed_seconds(run, device, reps), default=float("inf")), 1e-9)


def memory_bandwidth_gb_s(device: torch.device, buffer_mib: int = 4096, reps: int = 5) -> float:
    src = torch.empty(buffer_mib << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, reps)
    return 2 * src.numel() / seconds / 1e9


def matmul_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 8192, reps: int = 5) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), device, reps)
    return 2 * size**3 / seconds / 1e12
