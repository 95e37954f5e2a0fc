"""loadtest/bench_fixed_batch.py (against real processes) and loadtest/simulate_fixed_batch.py run end to end at
tiny sizes and report what they promise; no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_the_benchmark_sweeps_rates_against_the_real_fleet():
    out = subprocess.run([sys.executable, str(LOADTEST / "bench_fixed_batch.py"), "--rates", "40", "80", "--rounds",
                          "1", "--duration-s", "0.5", "--warmup-s", "0.2", "--workers", "1", "--latency-ms", "50"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    summary = last_json(out)
    assert [row["rate"] for row in summary["rows"]] == [40, 80]
    for row in summary["rows"]:
        assert row["errors"] == 0 and row["achieved_rps"] > 0 and 0 < row["mean_batch_fill"] <= 1
        assert {"p50_ms", "p95_ms", "p99_ms", "accelerators_busy", "floor_accelerators",
                "cpu_ms_per_call_gateway", "cpu_ms_per_call_router"} <= row.keys()


def test_the_simulation_plans_at_least_the_floor():
    out = subprocess.run([sys.executable, str(LOADTEST / "simulate_fixed_batch.py"), "--case", "500", "50", "200",
                          "--duration-s", "2"], capture_output=True, text=True, timeout=120, check=True).stdout
    (row,) = last_json(out)["rows"]
    assert row["floor_accelerators"] == 2.0 and row["accelerators_needed"] >= 2 and row["p95_ms"] <= 500
