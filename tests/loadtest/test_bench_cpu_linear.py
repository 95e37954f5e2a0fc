"""The CPU linear benchmark times oneDNN and the panel matmul on the same weights and inputs: their outputs must
agree (so its timings compare like with like), at every linear shape of a size and at each row count."""

import json

import pytest

from flotilla.engine.model import cpu_linear
from loadtest import bench_cpu_linear
from tests.support.kernels import needs_kernels

pytestmark = [needs_kernels,
              pytest.mark.skipif(not cpu_linear.onednn_works(), reason="this torch build has no oneDNN linear")]


def test_both_matmuls_agree_at_every_shape_and_row_count(capsys):
    bench_cpu_linear.main(["--size", "micro", "--rows", "1", "9", "70", "--rounds", "1", "--gap-us", "1",
                           "--flops-per-round", "1e5"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["linear"], r["rows"]) for r in report["results"]] == [
        (name, rows) for name in ("qkv", "o", "gate_up", "down", "lm_head") for rows in (1, 9, 70)]
    for result in report["results"]:
        assert result["max_rel_difference"] <= 1e-5, result
        assert all(us > 0 for us in result["us"].values()), result
