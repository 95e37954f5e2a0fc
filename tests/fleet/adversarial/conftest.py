"""The adversarial fleet: router, one worker (the tiny random model) and a gateway process with an API key, a
usage ledger file and short connection deadlines, so that a misbehaving client is cut within seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fleet import MODEL, Fleet, fleet_config, start_fleet

HEADER_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 1024 * 1024


@pytest.fixture(scope="package")
def adversarial_fleet(tiny_checkpoint: Path, tmp_path_factory) -> Fleet:
    state_dir = tmp_path_factory.mktemp("adversarial-fleet")
    gateway_args = ["--usage-log", str(state_dir / "usage.jsonl"), "--max-body-bytes", str(MAX_BODY_BYTES),
                    "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(HEADER_TIMEOUT_S),
                    "--write-timeout-s", str(WRITE_TIMEOUT_S),
                    "--default-model", MODEL]  # bodies without a model (the fuzzer's, the examples) reach it
    config = fleet_config(tiny_checkpoint, state_dir, worker_args=["--num-kv-blocks", "512"],
                          gateway_args=gateway_args)
    with start_fleet(config, keys={"k-attacker": ("mallory", "paid")}) as fleet:
        yield fleet
