"""The machine's memory bandwidth, measured the simple way: stream a buffer much larger than the caches.

A single-stream decode step reads every weight once and does ~2 FLOPs per weight read, so its floor is the
weight bytes over the read bandwidth, not a compute rate. `read` sums the buffer (one read per element, the
access pattern of a matrix-vector product); `copy` reads one buffer and writes another (bytes counted both
ways, as STREAM's copy does). Each figure is the median of `reps` timed passes after one warm-up; `best` is
the highest, what a floor should use (the machine can do at least that).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch


class Bandwidth(NamedTuple):
    torch_read_gb_s: float  # torch.sum at torch's current thread count
    torch_copy_gb_s: float  # Tensor.copy_, read + write bytes
    numpy_read_gb_s: float  # np.sum, one thread
    numpy_copy_gb_s: float  # np.copyto, one thread, read + write bytes
    buffer_mib: int
    reps: int

    @property
    def best_gb_s(self) -> float:
        return max(self.torch_read_gb_s, self.torch_copy_gb_s, self.numpy_read_gb_s, self.numpy_copy_gb_s)


def measure_bandwidth(buffer_mib: int = 512, reps: int = 7) -> Bandwidth:
    if buffer_mib < 1 or reps < 1:
        raise ValueError(f"buffer_mib and reps must be >= 1, got {buffer_mib} and {reps}")
    num_bytes = buffer_mib << 20
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), dst.numpy()
    return Bandwidth(
        torch_read_gb_s=num_bytes / _median_seconds(lambda: src.sum(), reps) / 1e9,
        torch_copy_gb_s=2 * num_bytes / _median_seconds(lambda: dst.copy_(src), reps) / 1e9,
        numpy_read_gb_s=num_bytes / _median_seconds(lambda: src_np.sum(), reps) / 1e9,
        numpy_copy_gb_s=2 * num_bytes / _median_seconds(lambda: np.copyto(dst_np, src_np), reps) / 1e9,
        buffer_mib=buffer_mib,
        reps=reps,
    )


def _median_seconds(operation: Callable[[], object], reps: int) -> float:
    operation()  # warm-up: page faults and thread start-up are not bandwidth
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        operation()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
