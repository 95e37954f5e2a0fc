"""Host data to the device without waiting for the work already queued there: with overlap scheduling (engine.py,
step) a step is launched while the one before still runs, and a copy that waited for the stream would undo that.

A copy from pageable host memory lets the driver wait for the stream when it has to stage the data (CUDA's API
synchronisation notes), so on CUDA the data goes through pinned memory: torch's caching host allocator hands out a
pinned block, and since the asynchronous copy records an event on it, the block is not reused before the copy is
done. On a CPU the tensor is used as it is."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(host: torch.Tensor | np.ndarray | Sequence, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`host` (a tensor on the CPU, a numpy array or a list) as a tensor on `device`, copied asynchronously."""
    device = torch.device(device)
    if isinstance(host, np.ndarray):
        tensor = torch.from_numpy(host)
    elif isinstance(host, torch.Tensor):
        tensor = host
    else:
        tensor = torch.tensor(host, dtype=dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return pinned(tensor, device).to(device, non_blocking=True)


def pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor to copy asynchronously to `device`: its pinned copy when that is a GPU, else itself."""
    return tensor.pin_memory() if torch.device(device).type == "cuda" else tensor
