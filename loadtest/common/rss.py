"""This process's resident memory, as the kernel reports it."""

from __future__ import annotations

from pathlib import Path


def read_rss_kib(status_path: Path = Path("/proc/self/status")) -> int:
    """VmRSS in KiB. Raises OSError where /proc is missing (not Linux) rather than guessing."""
    for line in status_path.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise OSError(f"no VmRSS line in {status_path}")
