"""The single-stream decode benchmark runs end to end with tiny settings and ends with one parseable JSON line.
No timing is asserted: only that both systems ran every round and the floor is the weight bytes over the
bandwidth (the median of each round's best figure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "loadtest" / "bench_decode.py"


def test_decode_benchmark_reports_both_systems_and_the_memory_floor(tiny_checkpoint):
    done = subprocess.run([sys.executable, str(SCRIPT), "--model-dir", str(tiny_checkpoint), "--rounds", "2",
                           "--output-len", "4", "--threads", "1", "--bandwidth-mib", "16"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary["decode_ms_per_token"]) == {"engine", "transformers"}
    assert all(len(rounds) == 2 for rounds in summary["decode_ms_per_token_rounds"].values())
    assert summary["num_parameters"] == 5_048_576 and summary["weight_bytes_fp32"] == 4 * 5_048_576
    assert all(summary[key] > 0 for key in ("torch_read_gb_s", "torch_copy_gb_s", "numpy_read_gb_s", "numpy_copy_gb_s"))
    expected_floor = summary["weight_bytes_fp32"] / (summary["floor_bandwidth_gb_s"] * 1e9) * 1e3
    assert abs(summary["memory_floor_ms_per_token"] - expected_floor) < 0.01 + 0.01 * expected_floor
    assert "memory floor:" in done.stderr and "round 2:" in done.stderr
