"""The device check's CPU side: with --dry-run every step runs at tiny shapes on the CPU and the JSON line has
every figure (the fp32 engine equal to transformers there too); without CUDA and without --dry-run it stops with
a clear message. The real run is loadtest/gpu_check.py on a CUDA machine."""

import json

import pytest
import torch

from loadtest import gpu_check


def test_dry_run_reports_every_figure(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--work-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    exact = report["exactness"]
    assert exact["fp32_greedy_equal"] is True and exact["fp32_agreement"] == 1.0
    assert exact["distinct_reference_tokens"] > 2  # the prompts' continuations differ: the comparison means something
    assert 0.0 <= exact["fp8_kv_agreement_with_bf16_kv"] <= 1.0 and exact["fp8_kv_max_logprob_error"] >= 0.0
    assert exact["swap_agreement_with_fp32"] == 1.0 and exact["swap_preemptions"] > 0
    performance = report["performance"]
    for side in ("engine", "transformers"):
        assert all(value > 0 for key, value in performance[side].items() if key.endswith(("_s", "_batch1")))
    assert set(report["targets"]) >= {"decode_vs_memory_floor", "prefill_share_of_compute_floor",
                                      "batch_speedup_vs_transformers"}
    assert list(tmp_path.iterdir()) == []  # the random checkpoints are removed


def test_agreement_counts_tokens_before_the_first_difference():
    assert gpu_check.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == 1.0
    assert gpu_check.agreement([[1, 9, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == pytest.approx(3 / 5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_it_says_so(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_failing_section_is_reported_and_the_rest_runs(capsys):
    report: dict = {}

    def broken():
        raise RuntimeError("triton compile failed")

    assert gpu_check._section(report, "kernel", broken) == {"error": "RuntimeError: triton compile failed"}
    assert gpu_check._section(report, "exactness", lambda: {"ok": True}) == {"ok": True}
    assert "Traceback" in capsys.readouterr().err
