"""How much KV cache one model of a shared-pool worker may take on a GPU.

A one-model worker gives its KV pool 85% of the memory left once its weights are loaded. A shared-pool worker
holding up to N models cannot: the first model's pool would leave no room for the second one's weights. Each
load slot gets an equal share of the device memory free when the worker started (the same 85%), and a model's
KV pool is its slot's share less its weights (their size on disk: at most what they take loaded, a float32
checkpoint served in bfloat16 takes half) and its CUDA-graph pool. An explicit --kv-cache-memory-bytes or
--num-kv-blocks applies to every model as given; on a CPU each model gets the engine's CPU default.
"""

from __future__ import annotations

from pathlib import Path

from flotilla.engine.config import GPU_KV_MEMORY_FRACTION


class DoesNotFitError(ValueError):
    """A model's weights alone take its slot's share of the device memory."""


def checkpoint_bytes(model_dir: str | Path) -> int:
    return sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))


def slot_kv_budget(free_bytes_at_start: int, max_loaded: int, weights_bytes: int, graph_bytes: int = 0,
                   fraction: float = GPU_KV_MEMORY_FRACTION) -> int:
    """KV bytes for one model in one of `max_loaded` equal slots; raises DoesNotFitError when nothing is left."""
    share = int(free_bytes_at_start * fraction) // max_loaded
    budget = share - weights_bytes - graph_bytes
    if budget <= 0:
        raise DoesNotFitError(f"weights of {weights_bytes / 2**30:.1f} GiB (+ {graph_bytes / 2**30:.1f} GiB of CUDA "
                              f"graphs) do not fit in one of {max_loaded} slots of {share / 2**30:.1f} GiB: lower "
                              f"--max-loaded-models or set --kv-cache-memory-bytes")
    return budget
