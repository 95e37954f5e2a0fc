"""The attention-kernel benchmark runs end to end and ends with one parseable JSON line: a prefill and a decode
row per layout, each timed through both paths. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kernels import needs_kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "loadtest" / "bench_attention_kernels.py"


@needs_kernels
def test_attention_kernel_benchmark_reports_both_paths_for_each_step():
    done = subprocess.run([sys.executable, str(SCRIPT), "--reps", "1", "--threads", "1", "--layouts", "tiny"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(row["layout"], row["step"]) for row in summary["results"]] == [("tiny", "prefill"), ("tiny", "decode")]
    for row in summary["results"]:
        assert row["kernel_ms"] > 0 and row["torch_ms"] > 0
        assert row["speedup"] == pytest.approx(row["torch_ms"] / row["kernel_ms"], rel=0.05)
