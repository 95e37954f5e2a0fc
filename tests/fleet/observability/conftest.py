"""One real fleet (router, worker, gateway as processes) exporting traces over OTLP/HTTP to a receiver in
the test, with its router and worker serving /metrics on free ports. Two API keys: the Prometheus test
sends as the `paid` tier and the trace tests as the `free` tier, so neither counts the other's requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fleet import Fleet, fleet_config, start_fleet


@pytest.fixture(scope="package")
def observed_fleet(tiny_checkpoint: Path, tmp_path_factory) -> Fleet:
    config = fleet_config(tiny_checkpoint, tmp_path_factory.mktemp("observed-fleet"),
                          worker_args=["--num-kv-blocks", "128"])
    keys = {"k-paid": ("acme", "paid"), "k-free": ("hobbyist", "free")}
    with start_fleet(config, keys=keys, otlp=True) as fleet:
        yield fleet
