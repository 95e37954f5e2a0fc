"""The serving benchmark and the report runner against the real fleet (router, worker, gateway processes):
every request streams and is timed, failures are counted by reason, and the A/B report is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench_serving, run_serving

from tests.support.fleet import MODEL, Fleet, fleet_config, start_fleet


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint: Path, tmp_path_factory) -> Fleet:
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("loadtest-fleet"),
                          worker_args=["--num-kv-blocks", "256"], metrics=False)
    with start_fleet(config, keys={"k-paid": ("t-paid", "paid"), "k-free": ("t-free", "free")}) as running:
        yield running


def _json_line(out: str) -> dict | list:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_serving_times_every_streamed_request(fleet, capsys):
    code = bench_serving.main(["--base-url", f"{fleet.url}/v1", "--model", MODEL, "--api-key",
                               fleet.keys["k-paid"], "--num-prompts", "8", "--request-rate", "20",
                               "--max-concurrency", "4",
                               "--output-tokens", "4", "8", "--no-progress"])
    line = _json_line(capsys.readouterr().out)
    assert code == 0
    assert (line["num_ok"], line["num_errors"], line["errors"]) == (8, 0, {})
    assert 8 <= line["output_tokens"] <= 64 and line["prompt_tokens"] > 8 * 16
    assert line["ttft_p50_ms"] > 0 and line["ttft_p50_ms"] <= line["ttft_p99_ms"] <= line["e2e_p99_ms"]
    assert line["output_tok_s"] > 0 and line["request_rate"] == 20


def test_failures_are_counted_by_http_status(fleet, capsys):
    code = bench_serving.main(["--base-url", f"{fleet.url}/v1", "--model", MODEL, "--api-key",
                               "not-a-key", "--num-prompts", "3", "--no-progress"])
    line = _json_line(capsys.readouterr().out)
    assert code == 1 and line["num_ok"] == 0 and line["errors"] == {"401": 3}


def test_report_with_tiers_and_an_ab_comparison(fleet, tmp_path, capsys):
    url, paid, free = f"{fleet.url}/v1", fleet.keys["k-paid"], fleet.keys["k-free"]
    run_serving.main(["--base-url", url, "--model", MODEL, "--tenant", f"acme:paid:{paid}",
                      "--tenant", f"hobby:free:{free}", "--compare-base-url", url,
                      "--compare-api-key", paid, "--num-requests", "6", "--rate", "30", "--arrival", "bursty",
                      "--output-tokens", "2", "4", "--out", str(tmp_path)])
    summaries = _json_line(capsys.readouterr().out)
    assert [s["endpoint"] for s in summaries] == [f"A: {MODEL}", f"B: {MODEL}"]
    assert all(s["num_ok"] == 6 for s in summaries)
    report = (tmp_path / "report.md").read_text()
    assert "| paid | TTFT |" in report and "| free | TTFT |" in report and "## B: " in report
    for png in ("latency_cdf.png", "over_time.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
