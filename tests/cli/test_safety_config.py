"""A safety config that cannot be used stops `flotilla gateway` at start-up with one line naming the rule and why:
no traceback, exit status 2, nothing served."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_startup_errors import run_cli


@pytest.mark.parametrize(("policies", "expected"), [
    ({"p": {"rules": [{"category": "loops", "patterns": [r"(a)\1"]}]}},
     r"rule 'loops': pattern '(a)\\1' is not valid RE2 syntax: invalid escape sequence: \1"),
    ({"p": {"rules": [{"category": "all", "patterns": ["x*"]}]}}, "matches the empty string"),
])
def test_bad_safety_config_stops_the_gateway(tmp_path, policies, expected):
    config = tmp_path / "safety.json"
    config.write_text(json.dumps({"default": "p", "policies": policies}))
    result = run_cli("gateway", "--router", "127.0.0.1:1", "--no-auth", "--insecure-internal", "--port", "0",
                     "--safety-config", config, cwd=tmp_path)
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr
