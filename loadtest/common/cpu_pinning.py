"""Pin processes to CPU cores (Linux): every thread a process has now, and so every thread those create later.

`os.sched_setaffinity(pid)` sets the mask of one thread only (the one whose id is `pid`); a process whose
helper threads already run (gRPC's poller, a tokenizer pool) needs each of its tasks pinned.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def pin_process(pid: int, cores: Iterable[int]) -> None:
    mask = set(cores)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def split_cores(num_engine_cores: int) -> tuple[list[int], list[int]]:
    """(engine cores, the rest) out of the cores this process may use; both non-empty."""
    available = sorted(os.sched_getaffinity(0))
    if not 0 < num_engine_cores < len(available):
        raise ValueError(f"--engine-cores must leave at least one of the {len(available)} cores for the path")
    return available[:num_engine_cores], available[num_engine_cores:]


def spawned_engine_pids(pid: int) -> list[int]:
    """The engine processes a worker started with --engine-process (multiprocessing spawn children; not its
    resource tracker)."""
    children: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as listing:
                children += [int(child) for child in listing.read().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    engines = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                if b"spawn_main" in cmdline.read():
                    engines.append(child)
        except FileNotFoundError:
            pass
    return engines
