"""loadtest/bench_admission.py runs end to end (tiny sizes) and reports 1 vs 3 Redis round trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "loadtest" / "bench_admission.py"


def test_benchmark_smoke():
    out = subprocess.run([sys.executable, str(BENCH), "--requests", "64", "--concurrency", "8"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.startswith(("redis", "file"))}
    assert float(rows[("redis", "off")][-1]) == 1.0 and float(rows[("redis", "on")][-1]) == 3.0
    assert float(rows[("file+local", "on")][-1]) == 0.0
