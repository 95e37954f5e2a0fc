"""The MoE experts benchmark runs end to end at tiny shapes and reports both ways at every token count."""

import json

from loadtest import bench_moe_experts


def test_reports_both_ways_at_every_token_count(capsys):
    bench_moe_experts.main(["--shape", "tiny", "--tokens", "1", "8", "--rounds", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["grouped_vs_loop_max_error_relative"] < 1e-5
    assert report["engine_picks_grouped"] and report["start_up_probe_keeps_grouped"]  # a CPU, rows aligned
    assert all(report[f"{way}_ms_{n}_tokens"] > 0 for way in ("grouped", "loop") for n in (1, 8))
