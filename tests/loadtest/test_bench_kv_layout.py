"""The K/V layout benchmark's candidate kernel computes the engine kernel's attention (so its timing compares
like with like): at a small scale, both layouts, key tails that fill no whole tile or block."""

import json

import pytest

from flotilla.engine.model import decode_kernel
from loadtest import bench_kv_layout

pytestmark = pytest.mark.skipif(decode_kernel.load() is None, reason="no C compiler for the kernels")


def test_candidate_matches_the_engine_kernel(capsys):
    assert bench_kv_layout.main(["--size", "tiny", "small", "--block-sizes", "16", "32", "--layers", "2",
                                 "--seqs", "5", "--context", "37", "--rounds", "1", "--threads", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(report["results"]) == 4
    for result in report["results"]:
        assert result["max_abs_difference"] <= 1e-5, result
        assert result["engine_ms_per_layer"] > 0 and result["candidate_ms_per_layer"] > 0
