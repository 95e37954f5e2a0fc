"""The engine benchmark runs end to end with tiny settings and ends with one parseable JSON line. No timing
is asserted: only that every system ran, the token counts add up, and the vLLM path parses its child's output
(a stand-in `vllm` module here: the real CPU build is not installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.models.checkpoint import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "loadtest" / "bench_engine.py"
TINY = ["--num-requests", "4", "--prompt-len", "8", "16", "--output-len", "3", "6", "--gemm-size", "128",
        "--threads", "1"]

# Mimics the slice of vLLM's offline API that the benchmark's child script uses.
FAKE_VLLM = '''
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, max_tokens, min_tokens=0, ignore_eos=False, temperature=1.0):
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, n):
        self.token_ids = [5] * n

class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]

class LLM:
    calls = 0

    def __init__(self, model, dtype, **kwargs):
        assert dtype == "float32"

    def generate(self, prompts, params, use_tqdm=True):
        import os
        assert all("prompt_token_ids" in p for p in prompts)
        LLM.calls += 1
        if LLM.calls == int(os.environ.get("FAKE_VLLM_DIE_ON_CALL", "0")):
            raise SystemExit("fake vLLM stops here")
        return [_Output(p.max_tokens) for p in params]
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("bench-tiny"), size="tiny", seed=0))


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """The environment for a run whose `--compare-vllm sys.executable` imports the stand-in vllm module."""
    fake = tmp_path / "fake_site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}


def _run(args: list[str], env: dict[str, str] | None = None) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    last_line = done.stdout.strip().splitlines()[-1]
    return json.loads(last_line), done.stdout


def test_throughput_run_reports_every_system(model_dir, env):
    args = [*TINY, "--model-dir", model_dir, "--transformers-sample", "2", "--transformers-batch-size", "2",
            "--compare-vllm", sys.executable]
    summary, stdout = _run(args, env)
    assert summary["mode"] == "throughput" and summary["num_requests"] == 4
    assert 4 * 8 <= summary["prompt_tokens"] <= 4 * 16 and 4 * 3 <= summary["output_tokens"] <= 4 * 6
    for key in ("engine_tok_s", "transformers_1_tok_s", "transformers_batch_tok_s", "vllm_tok_s", "floor_tok_s"):
        assert summary[key] > 0, key
    assert summary["transformers_1_is_sample"] and summary["transformers_1_requests_timed"] == 2
    assert summary["engine_over_transformers_batch"] is not None and summary["engine_over_vllm"] is not None
    assert summary["vllm_skipped_reason"] is None and summary["threads"] == 1
    assert summary["num_parameters"] == 5_048_576  # tiny, tied: the vocabulary matrix counted once
    assert "sample of 2 of 4 requests" in stdout


def test_missing_vllm_interpreter_is_skipped_and_transformers_can_be_skipped(tmp_path):
    # Untied: embedding and lm_head both stored, the vocabulary matrix still counted once (only lm_head
    # does a matmul), so the count equals the tied checkpoint's.
    untied = str(write_checkpoint(tmp_path / "untied", size="tiny", seed=0, tie_word_embeddings=False))
    args = [*TINY, "--model-dir", untied, "--skip-transformers-single", "--skip-transformers-batch",
            "--compare-vllm", str(tmp_path / "no-such-python")]
    summary, stdout = _run(args)
    assert summary["vllm_tok_s"] is None and "not found" in summary["vllm_skipped_reason"]
    assert summary["transformers_1_tok_s"] is None and summary["engine_over_transformers_1"] is None
    assert summary["engine_tok_s"] > 0 and "not found" in stdout
    assert summary["num_parameters"] == 5_048_576


def test_memory_check_reports_rss_per_wave(model_dir):
    summary, stdout = _run(["--model-dir", model_dir, "--memory-check", "6", "--wave-size", "2", "--threads", "1"])
    assert summary["mode"] == "memory_check" and len(summary["rss_kib"]) == 3
    assert all(rss > 0 for rss in summary["rss_kib"]) and summary["kv_blocks_all_free"] is True
    assert isinstance(summary["grew_over_5pct"], bool) and isinstance(summary["grew_over_5pct_second_half"], bool)
    assert summary["rss_growth_second_half"] == round(summary["rss_kib"][-1] / summary["rss_kib"][1] - 1, 4)
    assert stdout.count("RSS") >= 3


def test_waves_run_one_after_another_through_engine_and_vllm(model_dir, env):
    """--waves 2: twice the requests, in two waves timed back to back by both systems, rates over both."""
    common = [*TINY, "--model-dir", model_dir, "--skip-transformers-single", "--skip-transformers-batch",
              "--compare-vllm", sys.executable]
    one, _ = _run(common, env)
    two, stdout = _run([*common, "--waves", "2"], env)
    assert (one["waves"], two["waves"]) == (1, 2) and two["num_requests"] == 8
    assert two["output_tokens"] > one["output_tokens"] and two["prompt_tokens"] > one["prompt_tokens"]
    assert two["vllm_tok_s"] > 0 and two["engine_over_vllm"] is not None
    assert stdout.count("; waves ") == 2  # the engine's and vLLM's per-wave seconds


def test_alternate_waves_time_each_wave_on_both_systems(model_dir, env):
    """--alternate-waves keeps vLLM loaded beside the engine, runs wave i on both before wave i + 1, and reports each
    wave's own ratio and their median. A vLLM that dies part way is reported as skipped, not as a result."""
    common = [*TINY, "--model-dir", model_dir, "--skip-transformers-single", "--skip-transformers-batch",
              "--compare-vllm", sys.executable, "--waves", "3", "--alternate-waves"]
    summary, stdout = _run(common, env)
    assert summary["alternate_waves"] and summary["vllm_skipped_reason"] is None and summary["vllm_tok_s"] > 0
    by_wave = summary["engine_over_vllm_by_wave"]
    assert len(by_wave) == 3 and all(r > 0 for r in by_wave)
    assert summary["engine_over_vllm_wave_median"] == pytest.approx(sorted(by_wave)[1], abs=1e-4)
    assert "wave by wave" in stdout and stdout.count("; waves ") == 2
    # vLLM calls: 1 the warm-up, 2 wave 0, 3 wave 1, which dies
    died, stdout = _run(common, {**env, "FAKE_VLLM_DIE_ON_CALL": "3"})
    assert died["vllm_tok_s"] is None and died["engine_over_vllm_by_wave"] is None
    assert "exited" in died["vllm_skipped_reason"] and "fake vLLM stops here" in died["vllm_skipped_reason"]
    assert died["engine_tok_s"] > 0


def test_alternate_waves_need_vllm(model_dir):
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--model-dir", model_dir, "--alternate-waves"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--compare-vllm" in done.stderr


def test_the_first_wave_is_the_one_wave_workload():
    """--waves N draws N x --num-requests requests from the same seed: its first wave is --waves 1's workload."""
    from loadtest.common.engine_workload import LengthRange, make_workload

    def draw(num_requests):
        return make_workload(num_requests, 100, {0}, LengthRange(8, 16), LengthRange(3, 6), seed=7)

    first_wave = draw(12).subset(list(range(4)))
    assert first_wave == draw(4)
