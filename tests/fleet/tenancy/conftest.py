"""The tenancy fleet, shared by the fleet test modules (the Redis outage test restarts Redis with its data)."""

from __future__ import annotations

import pytest

from .fleet_harness import TenancyFleet, start_fleet


@pytest.fixture(scope="package")
def tenancy_fleet(tiny_checkpoint, tmp_path_factory) -> TenancyFleet:
    # Small free/batch wait budgets, so that the overload test sheds within seconds on a tiny model.
    harness = start_fleet(tiny_checkpoint, tmp_path_factory.mktemp("tenancy-fleet"),
                          ["--wait-budget-free-s", "1.0", "--wait-budget-batch-s", "0.5"])
    yield harness
    harness.stop()
