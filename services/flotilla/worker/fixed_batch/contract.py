"""The run_batch contract and how a worker loads one.

    run_batch(inputs: list[str]) -> list[str]
      - 1 to B inputs per call; one output per input, in order; one call at a time per accelerator

`--run-batch MODULE:NAME` names either a plain run_batch callable (used as it is) or a factory with a
`from_options(BatchOptions)` classmethod (the shipped backends: their L, B and model come from the flags).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

RunBatch = Callable[[list[str]], list[str]]

SIMULATED = "flotilla.worker.fixed_batch.simulated:SimulatedAccelerator"
ENGINE = "flotilla.worker.fixed_batch.engine_batch:EngineBatch"


class ContractError(Exception):
    """run_batch broke its contract (wrong number or type of outputs), or was called outside it."""


@dataclass(frozen=True)
class BatchOptions:
    """What a factory may read (flags of `flotilla worker --backend fixed-batch`)."""

    max_batch_size: int = 50  # B
    batch_latency_ms: float = 200.0  # L (the simulated accelerator sleeps exactly this long)
    model_dir: str | None = None  # the engine backend's checkpoint
    max_tokens: int = 16  # the engine backend's greedy output length
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.batch_latency_ms < 0 or self.max_tokens < 1:
            raise ValueError("batch_latency_ms must be >= 0 and max_tokens >= 1")


def load_run_batch(import_path: str, options: BatchOptions) -> RunBatch:
    module_name, sep, attr = import_path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--run-batch expects MODULE:NAME, got {import_path!r}")
    target = getattr(importlib.import_module(module_name), attr)
    factory = getattr(target, "from_options", None)
    run_batch = factory(options) if factory is not None else target
    if not callable(run_batch):
        raise ValueError(f"{import_path} is not callable")
    return run_batch


def checked_call(run_batch: RunBatch, inputs: list[str], max_batch_size: int) -> list[str]:
    """Call run_batch within its contract and check what it returned (raises ContractError)."""
    if not 1 <= len(inputs) <= max_batch_size:
        raise ContractError(f"a batch takes 1 to {max_batch_size} inputs, got {len(inputs)}")
    outputs = run_batch(list(inputs))
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise ContractError(f"run_batch returned {got} outputs for {len(inputs)} inputs")
    if not all(isinstance(output, str) for output in outputs):
        raise ContractError("run_batch returned a non-string output")
    return outputs
