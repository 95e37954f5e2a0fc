"""The tenancy fleet, shared by the fleet test modules: its own Redis (the Redis outage test stops it and starts
it again, with its data), two routers (the model's queue, and so its fairness, lives on the one its name hashes
to in every gateway: gateway/router_pool.py), one worker registered with both, and three gateway processes
sharing keys and quotas through Redis (two fail closed, the third fails open)."""

from __future__ import annotations

import pytest

from tests.support.fleet import Fleet, fleet_config, start_fleet
from tests.support.redis_server import RedisServer

MAX_REQUESTS_PER_WORKER = 4  # the router, not the engine, holds the backlog: fair queueing applies


@pytest.fixture(scope="package")
def tenancy_fleet(tiny_checkpoint, tmp_path_factory) -> Fleet:
    state_dir = tmp_path_factory.mktemp("tenancy-fleet")
    # Small free/batch wait budgets, so that the overload test sheds within seconds on a tiny model.
    budgets = ["--wait-budget-free-s", "1.0", "--wait-budget-batch-s", "0.5"]
    config = fleet_config(tiny_checkpoint, state_dir, num_routers=2, worker_args=["--num-kv-blocks", "512"],
                          router_args=["--max-requests-per-worker", str(MAX_REQUESTS_PER_WORKER)],
                          gateway_args=["--redis-fail-mode", "closed", *budgets])
    redis = RedisServer(state_dir / "redis").start()
    try:
        gateways = [["--redis-fail-mode", "closed", *budgets], ["--redis-fail-mode", "open", *budgets]]
        with start_fleet(config, redis=redis, gateways=gateways) as fleet:
            yield fleet
    finally:
        redis.stop()
