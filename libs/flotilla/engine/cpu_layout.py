"""The engine's thread on CPUs of its own, the rest of its process (gRPC, the event loop) on the others (Linux).

In a worker the engine thread and the serving loop share one process: pinned together to the engine's cores,
the loop's per-token work (protobuf, session writes) takes the engine's CPU. `--engine-cpus` keeps them
apart the way a GPU worker is laid out, the loop on other cores. They still share the GIL: the loop runs
while the engine is inside a torch kernel, which releases it.

`os.sched_setaffinity(0, ...)` sets the calling *thread's* mask on Linux, and a new thread starts with its
creator's mask, so: every thread the process has is moved to the other CPUs before the engine thread starts,
and the engine thread moves itself first thing (torch's intra-op threads it starts then inherit its CPUs).
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0', '0,2' or '0-3' (the kernel's cpulist format); ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"not a CPU list (like 0,2 or 0-3): {text!r}")
        cpus.update(range(int(first), int(last if sep else first) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list: {text!r}")
    return frozenset(cpus)


def other_cpus(engine_cpus: Iterable[int]) -> frozenset[int]:
    """The CPUs this process may use, less the engine's; ValueError unless both sides keep at least one."""
    engine = frozenset(engine_cpus)
    available = frozenset(os.sched_getaffinity(0))
    if not engine <= available:
        raise ValueError(f"engine CPUs {sorted(engine)} are not all among this process's {sorted(available)}")
    rest = available - engine
    if not rest:
        raise ValueError(f"engine CPUs {sorted(engine)} leave none of {sorted(available)} for the serving loop")
    return rest


def move_process_threads(cpus: Iterable[int], pid: int | None = None) -> None:
    """Every thread a process (default: this one) has now onto `cpus`, and so every thread they create later:
    `os.sched_setaffinity(pid)` moves one thread only, and helper threads (gRPC's poller) may be running."""
    mask = set(cpus)
    for tid in os.listdir(f"/proc/{pid or 'self'}/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def pin_current_thread(cpus: Iterable[int]) -> None:
    os.sched_setaffinity(0, set(cpus))
