"""A real fleet for the fault tests: router, workers and gateway processes (LocalFleet) with keys, the
usage ledger and idempotency keys in a real Redis."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from flotilla.fleet.local import FleetConfig, LocalFleet
from flotilla.usage.record import UsageRecord
from flotilla.usage.sinks import read_redis

MODEL = "flotilla-tiny"
TENANT = "tenant-f"
KEY_ID = "fault-key"


@dataclass
class FaultFleet:
    fleet: LocalFleet
    redis_url: str
    api_key: str

    @property
    def url(self) -> str:
        return self.fleet.gateway_url

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    def ledger(self) -> list[UsageRecord]:
        with redis.Redis.from_url(self.redis_url) as client:
            return list(read_redis(client))

    def wait_ledger(self, count: int, timeout_s: float = 30.0) -> list[UsageRecord]:
        wait_for(lambda: len(self.ledger()) >= count, timeout_s, f"{count} usage records")
        return self.ledger()

    def restart_gateway(self) -> None:
        self.fleet.gateway.kill()
        self.fleet.gateway.start()  # same arguments: same port
        self.fleet.gateway.wait_port(60)
        self.fleet.wait_ready(60)

    def healthy_workers(self) -> int:
        from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
        import grpc

        with grpc.insecure_channel(self.fleet.router_address) as channel:
            listing = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
        return sum(w.healthy for w in listing.workers)


def start_fleet(checkpoint: Path, state_dir: Path, redis_url: str, num_workers: int,
                router_args: list[str] = (), worker_args: list[str] = ()) -> FaultFleet:
    api_key = create_key(redis_url)
    config = FleetConfig(model_dir=checkpoint, state_dir=state_dir, model_name=MODEL, num_workers=num_workers,
                         redis_url=redis_url, worker_args=["--num-kv-blocks", "512", *worker_args],
                         router_args=list(router_args), metrics=False)
    fleet = LocalFleet(config).start()
    fault_fleet = FaultFleet(fleet, redis_url, api_key)
    wait_for(lambda: fault_fleet.healthy_workers() == num_workers, 60, f"{num_workers} workers registered")
    # A fixed gateway port from now on: a restarted gateway must come back where its clients retry.
    fleet.gateway.args[fleet.gateway.args.index("--port") + 1] = str(fleet.gateway.port)
    return fault_fleet


def create_key(redis_url: str) -> str:
    """`flotilla keys create` as a real command; returns the key it printed."""
    out = subprocess.run([sys.executable, "-m", "flotilla.cli", "keys", "create", "--redis-url", redis_url,
                          "--tenant", TENANT, "--key-id", KEY_ID], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
