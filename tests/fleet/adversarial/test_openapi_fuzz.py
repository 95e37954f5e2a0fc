"""Schemathesis (the pinned CLI, as a user would run it) fuzzes the gateway's whole HTTP API from its own
/openapi.json against the real fleet: examples, coverage and fuzzing phases (no stateful phase: the API has no
links between operations). Checks: no 5xx, status codes, content types and bodies as documented (so every error
is in its dialect's shape), and invalid data rejected."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "negative_data_rejection")
MAX_EXAMPLES = 15  # per operation and phase; fuzzing repeats until TIME_BUDGET_S is spent
TIME_BUDGET_S = 60
# This fleet has no fixed-batch worker: every /v1/batch-generate is a 503 "no worker could take this request"
# (right for a fleet whose fixed-batch workers are starting; tests/fixed_batch serves that route for real).
EXCLUDED_PATHS = ("/v1/batch-generate",)
# A deadline is the client's own: x-flotilla-deadline-ms: 1 gets the documented 504 deadline exceeded, which the
# fuzzer would count as a server error. Every request carries a long one instead (its parsing:
# tests/gateway/test_hostile_input.py).
FIXED_HEADERS = {"x-flotilla-deadline-ms": "600000"}
# Schema-invalid data may also be refused as too large: the coverage phase's messages array of maxItems + 1 messages
# is a 40 MB body, a 413 before its schema is read (schemathesis' default list of rejections has no 413).
REJECTION_STATUSES = ("400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx")


def test_fuzzing_the_described_api_finds_no_5xx_and_no_undocumented_answer(adversarial_fleet, tmp_path: Path):
    st = Path(sys.executable).with_name("st")
    config = tmp_path / "schemathesis.toml"
    config.write_text("[checks.negative_data_rejection]\nexpected-statuses = [%s]\n"
                      % ", ".join(f'"{status}"' for status in REJECTION_STATUSES))
    command = [str(st), "--config-file", str(config), "run", f"{adversarial_fleet.url}/openapi.json",
               "--phases", "examples,coverage,fuzzing",
               "--checks", ",".join(CHECKS), "--max-examples", str(MAX_EXAMPLES), "--max-time", str(TIME_BUDGET_S),
               "--workers", "1", "--request-timeout", "60", "--seed", "17", "--generation-database", "none",
               "--no-color", "-H", f"Authorization: Bearer {adversarial_fleet.api_key}",
               *(arg for path in EXCLUDED_PATHS for arg in ("--exclude-path", path)),
               *(arg for name, value in FIXED_HEADERS.items() for arg in ("-H", f"{name}: {value}"))]
    run = subprocess.run(command, capture_output=True, text=True, timeout=TIME_BUDGET_S + 120, cwd=tmp_path)
    (tmp_path / "schemathesis.out").write_text(run.stdout + run.stderr)  # the whole report, for reading failures
    print(run.stdout[-6000:])
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-4000:]
    cases = re.search(r"(\d+) generated", run.stdout)
    assert cases and int(cases.group(1)) > 100, run.stdout[-3000:]
