"""The KV-format accuracy benchmark runs end to end on a tiny checkpoint, and refuses a range factor that would
not leave the model the same."""

import json

import pytest

from loadtest import bench_kv_dtype


def test_reports_every_format_against_the_models_own_cache(tiny_checkpoint, capsys):
    formats = ["float8_e4m3fn calibrated", "float8_e4m3fn unit", "float16"]
    bench_kv_dtype.main(["--model-dir", str(tiny_checkpoint), "--prompts", "2", "--new-tokens", "3",
                         "--kv-range-factor", "1024", "--formats", *formats])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["reference"] == "float32" and report["reference_tokens"] > 0
    assert list(report["formats"]) == formats
    for result in report["formats"].values():
        assert 0.0 <= result["agreement"] <= 1.0 and result["max_logprob_error"] >= result["mean_logprob_error"] >= 0
    assert report["formats"]["float8_e4m3fn calibrated"]["kv_cache_format"].startswith("float8_e4m3fn scales ")
    assert report["formats"]["float8_e4m3fn unit"]["kv_cache_format"] == "float8_e4m3fn"


@pytest.mark.parametrize("factor", ["3", "0", "-2"])
def test_a_factor_that_is_not_a_power_of_two_is_refused(factor):
    with pytest.raises(SystemExit):
        bench_kv_dtype.parse_args(["--kv-range-factor", factor])
