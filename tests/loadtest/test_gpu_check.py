"""The device check's CPU side: with --dry-run every step runs at tiny shapes on the CPU and the JSON line has
every figure (the fp32 engine equal to transformers there too); without CUDA and without --dry-run it stops with
a clear message. The real run is loadtest/gpu_check.py on a CUDA machine."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loadtest import gpu_check
from loadtest.common import gpu_host_syncs
from loadtest.common.timed_sections import TimedSections


def test_dry_run_reports_every_figure(tmp_path, capsys):
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    assert gpu_check.main(["--dry-run", "--work-dir", str(work_dir), "--report", str(tmp_path / "report.json")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "report.json").read_text()) and report["finished"]
    assert "out_of_time" not in report and set(report["section_seconds"]) >= {"exactness", "engine", "swap_streams"}
    exact = report["exactness"]
    assert exact["fp32_greedy_equal"] is True and exact["fp32_agreement"] == 1.0
    assert exact["distinct_reference_tokens"] > 2  # the prompts' continuations differ: the comparison means something
    for scales in ("", "_unit_scales"):
        assert 0.0 <= exact[f"fp8_kv{scales}_agreement_with_bf16_kv"] <= 1.0
        assert exact[f"fp8_kv{scales}_max_logprob_error"] >= 0.0
    assert exact["swap_agreement_with_fp32"] == 1.0 and exact["swap_preemptions"] > 0
    syncs = report["host_syncs"]  # on a CPU the steps run without the debug mode (it needs CUDA)
    assert syncs["checked"] is False and syncs["graphs_overlap"] and syncs["eager_overlap"]
    for way in ("graphs", "eager"):
        assert syncs[way] == {"decode_steps": {"steps": 12, "host_sync": "none"},
                              "steps_with_prefills": {"steps": 6, "host_sync": "none"}}
    performance = report["performance"]
    for side in ("engine", "transformers"):
        assert all(value > 0 for key, value in performance[side].items() if key.endswith(("_s", "_batch1")))
    assert all(value > 0 for value in performance["engine"]["beside_a_grammar"].values())
    assert set(report["targets"]) >= {"decode_vs_memory_floor", "prefill_share_of_compute_floor",
                                      "batch_speedup_vs_transformers"}
    assert list(work_dir.iterdir()) == []  # the random checkpoints are removed
    split = report["split_decode"]  # tests/conftest.py sets TRITON_INTERPRET=1: the split kernel runs
    assert split["max_abs_error_float32_forced"] < 1e-4 and split["max_abs_error_float32_window_forced"] < 1e-4
    assert split["batch1_ms_unsplit"] > 0 and split["batch1_ms_split"] > 0
    assert report["triton_compiles"] == {"skipped": "Triton's interpreter compiles nothing"}
    swaps = report["swap_streams"]
    assert swaps["staged"]["equal"] and swaps["unstaged"]["equal"] and swaps["rounds"] > 0
    moe = report["moe_grouped"]
    assert moe["grouped_vs_loop_max_error_relative"] < 1e-5
    assert moe["engine_picks_grouped"] and moe["start_up_probe_keeps_grouped"]  # a CPU, rows aligned
    assert all(moe[f"{way}_ms_{n}_tokens"] > 0 for way in ("grouped", "loop") for n in moe["shape"]["tokens"])
    graphs = report["moe_graphs"]  # on a CPU both runs are eager: the same tokens
    assert graphs["graphs_experts_grouped"] and graphs["graphs_cuda_graph_sizes"] == []
    assert graphs["greedy_agreement_graphs_vs_eager"] == 1.0
    assert all(graphs[f"{way}_decode_ms_per_token_batch1"] > 0 for way in ("graphs", "eager"))


def test_agreement_counts_tokens_before_the_first_difference():
    assert gpu_check.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == 1.0
    assert gpu_check.agreement([[1, 9, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == pytest.approx(3 / 5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_it_says_so(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_make_runs_it_on_a_python3_that_has_its_packages_without_installing(tmp_path):
    """The lent device machines have PyTorch, Triton and transformers in their python3 and no registry: there
    `make gpu-check` must not build the venv (pip would fail) but run the check on that python3. The project's
    interpreter stands in for it (a python3 on PATH), and PY names a venv that is not there."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not found")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # a script, not a link: a linked venv interpreter would not find its venv
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    repo = Path(__file__).resolve().parents[2]
    command = [make, "--no-print-directory", "-C", str(repo), "gpu-check", f"PY={tmp_path}/no-venv/python"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert f"no .venv; running on {bin_dir / 'python3'}" in result.stdout
    assert "no CUDA device" in result.stderr  # the check itself ran, and said why it stopped
    assert not (tmp_path / "no-venv").exists()  # nothing was installed


def test_a_failing_part_is_reported_and_the_rest_runs(capsys):
    report: dict = {}

    def broken():
        raise RuntimeError("triton compile failed")

    with TimedSections(report, budget_s=60) as parts:
        assert parts.run("kernel", broken) == {"error": "RuntimeError: triton compile failed"}
        assert parts.run("exactness", lambda: {"ok": True}) == {"ok": True}
    assert "Traceback" in capsys.readouterr().err
    assert set(report["section_seconds"]) == {"kernel", "exactness"}


def test_a_part_past_the_budget_is_stopped_and_the_later_ones_skipped(tmp_path):
    """The alarm stops a part even inside code that catches every Exception (as the engine's loops do), and the
    report on disk holds every part as it was recorded."""
    report: dict = {}
    report_path = tmp_path / "report.json"
    freed = []

    def swallows_exceptions():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                time.sleep(0.01)
            except Exception:  # noqa: BLE001 - what the alarm must get through
                pass
        return {"never": "reached"}

    began = time.monotonic()
    with TimedSections(report, budget_s=0.5, report_path=report_path, on_failure=lambda: freed.append(1)) as parts:
        assert parts.run("quick", lambda: {"ok": True}) == {"ok": True}
        assert "out_of_time" in parts.run("slow", swallows_exceptions)
        assert "skipped" in parts.run("after", lambda: {"ok": True})
    assert time.monotonic() - began < 10
    assert freed == [1]
    assert json.loads(report_path.read_text()) == report
    assert report["quick"] == {"ok": True} and "after" not in report["section_seconds"]


def test_the_budget_spent_between_parts_skips_the_next_one(tmp_path):
    """Between parts (a checkpoint written or removed) the alarm stops nothing: the next part is skipped."""
    report: dict = {}
    with TimedSections(report, budget_s=0.2, report_path=tmp_path / "report.json") as parts:
        parts.run("quick", lambda: {"ok": True})
        time.sleep(1)  # the alarm lands here, outside any part, and this sleep runs to its end
        assert "skipped" in parts.run("next", lambda: {"ok": True})
    assert "out_of_time" not in report
    assert json.loads((tmp_path / "report.json").read_text()) == report


def test_a_dry_run_out_of_budget_still_prints_its_report(tmp_path, capsys):
    """The real script, stopped by its budget partway: it still exits 0 with one JSON line, the parts it finished
    in it, the one it stopped marked so and the rest skipped."""
    report_path = tmp_path / "report.json"
    assert gpu_check.main(["--dry-run", "--budget-s", "2", "--work-dir", str(tmp_path), "--report",
                           str(report_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads(report_path.read_text()) and report["finished"]
    parts = {**report, **report["performance"]}
    stopped = [name for name in report["section_seconds"] if "out_of_time" in parts[name]]
    assert len(stopped) <= 1  # the alarm stops the part running, or lands between two and stops none
    assert "skipped" in report["swap_streams"]  # the last part


def test_a_host_sync_is_reported_with_its_place_and_other_errors_are_not_taken_for_one():
    class Engine:
        def __init__(self, error_at: int, message: str):
            self.calls, self.error_at, self.message = 0, error_at, message

        def step(self):
            self.calls += 1
            if self.calls == self.error_at:
                raise RuntimeError(self.message)

    syncing = Engine(3, "called a synchronizing CUDA operation")
    report = gpu_host_syncs._checked(syncing, torch.device("cpu"), steps=5)
    assert report["steps"] == 2 and report["host_sync"].startswith("called a synchronizing CUDA operation at ")
    assert "step" in report["host_sync"]  # the frame that raised
    assert gpu_host_syncs._checked(Engine(9, ""), torch.device("cpu"), steps=5) == {"steps": 5, "host_sync": "none"}
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_host_syncs._checked(Engine(1, "CUDA out of memory"), torch.device("cpu"), steps=5)


def test_triton_compiles_count_recompiles_of_one_configuration():
    """A configuration (the declared constexprs) compiled twice shows, whatever its other arguments' specialisation."""
    from types import SimpleNamespace

    from loadtest.common.gpu_triton_compiles import kernel_compiles

    params = [SimpleNamespace(is_constexpr=flag) for flag in (False, True, False, True)]
    key_cache = {
        ((("*bf16", "D"), ("constexpr", 64), ("i32", "D"), ("constexpr", False)), "options"): "k1",
        ((("*bf16", "D"), ("constexpr", 64), ("i32", ""), ("constexpr", False)), "options"): "k2",  # same config
        ((("*bf16", "D"), ("constexpr", 64), ("i32", ""), ("constexpr", True)), "options"): "k3",
    }
    kernel = SimpleNamespace(params=params, device_caches={0: ({}, key_cache, None, None, None)})
    assert kernel_compiles(kernel) == {"compiles": 3, "configurations": 2, "most_compiles_of_one_configuration": 2}
