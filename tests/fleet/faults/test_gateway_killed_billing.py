"""A gateway killed (SIGKILL) mid-stream still bills the tokens it had delivered, once: its usage ledger (a
JSON-lines file here) holds the request's admission record and its checkpoints, and `flotilla usage` bills the
last checkpoint as one interrupted request (at most one checkpoint interval of delivered output short)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.support.fleet import MODEL, fleet_config, start_fleet
from tests.support.waiting import wait_until

CHECKPOINT_S = 0.2


def test_a_gateway_killed_mid_stream_bills_what_it_delivered_once(tiny_checkpoint, tmp_path):
    ledger = tmp_path / "usage.jsonl"
    config = fleet_config(tiny_checkpoint, tmp_path / "fleet", metrics=False, gateway_args=[
        "--usage-log", str(ledger), "--usage-checkpoint-s", str(CHECKPOINT_S)])
    with start_fleet(config, keys={"k1": ("acme", "paid")}) as fleet:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1800, "ignore_eos": True, "stream": True,
                "temperature": 0, "logprobs": 0}
        delivered, started = 0, time.monotonic()
        with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, headers=fleet.headers,
                          timeout=60) as response:
            assert response.status_code == 200
            try:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            delivered += len((choice.get("logprobs") or {}).get("tokens") or [])
                    if time.monotonic() - started > 4 * CHECKPOINT_S and delivered >= 8:
                        fleet.gateways[0].kill()  # SIGKILL: no shutdown, nothing flushed on the way out
                        wait_until(lambda: fleet.gateways[0].popen.poll() is not None, 10, "the gateway gone")
            except httpx.HTTPError:
                pass  # the connection died with the gateway
        assert delivered >= 8
        out = subprocess.run([sys.executable, "-m", "flotilla.cli", "usage", "--file", str(ledger), "--json"],
                             capture_output=True, text=True, check=True).stdout
    (acme,) = [json.loads(line) for line in out.splitlines()]
    assert acme["tenant"] == "acme" and acme["num_requests"] == 1 and acme["num_ok"] == 0
    assert 0 < acme["output_tokens"] <= delivered and acme["input_tokens"] == 3
