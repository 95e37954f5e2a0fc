"""CPU seconds (user + system) a set of processes spent during a block: where the cycles of a run went."""

from __future__ import annotations

import os
import resource
import time
from contextlib import contextmanager

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of one live process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces: split after it
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextmanager
def cpu_accounting(pids: dict[str, int], result: dict[str, float]):
    """Fill `result` with CPU seconds per named pid over the block, plus 'client' (this process) and 'wall'."""
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    own_before, wall_before = own_cpu_s(), time.perf_counter()
    yield result
    result.update({name: round(process_cpu_s(pid) - before[name], 2) for name, pid in pids.items()})
    result["client"] = round(own_cpu_s() - own_before, 2)
    result["wall"] = round(time.perf_counter() - wall_before, 2)
