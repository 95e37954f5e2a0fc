"""A real fleet for the tenancy tests: its own Redis, router, one worker, and three gateway processes
sharing keys and quotas through Redis (two fail closed, the third fails open)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flotilla.fleet.local import FleetConfig, LocalFleet
from flotilla.fleet.process import ServiceProcess

from tests.support.redis_server import RedisServer

MODEL = "flotilla-tiny"
MAX_REQUESTS_PER_WORKER = 4  # the router, not the engine, holds the backlog: fair queueing applies


@dataclass
class TenancyFleet:
    redis: RedisServer
    fleet: LocalFleet
    gateways: list[ServiceProcess] = field(default_factory=list)  # [0] from LocalFleet, [1], [2] extra

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{g.port}" for g in self.gateways]

    def create_key(self, tenant: str, *flags: str) -> str:
        """`flotilla keys create` as a real command; returns the key it printed."""
        out = subprocess.run([sys.executable, "-m", "flotilla.cli", "keys", "create", "--redis-url", self.redis.url,
                              "--tenant", tenant, *flags], capture_output=True, text=True, check=True)
        return out.stdout.strip().splitlines()[-1]

    def keys_command(self, *args: str) -> int:
        return subprocess.run([sys.executable, "-m", "flotilla.cli", "keys", *args, "--redis-url", self.redis.url],
                              capture_output=True, text=True).returncode

    def stop(self) -> None:
        for gateway in self.gateways[1:]:
            gateway.stop()
        self.fleet.stop()
        self.redis.stop()


def start_fleet(checkpoint: Path, state_dir: Path, gateway_args: list[str] = ()) -> TenancyFleet:
    redis = RedisServer(state_dir / "redis").start()
    config = FleetConfig(model_dir=checkpoint, state_dir=state_dir, model_name=MODEL, redis_url=redis.url,
                         worker_args=["--num-kv-blocks", "512"],
                         router_args=["--max-requests-per-worker", str(MAX_REQUESTS_PER_WORKER)],
                         gateway_args=["--redis-fail-mode", "closed", *gateway_args])
    fleet = LocalFleet(config)
    try:
        fleet.start()
        harness = TenancyFleet(redis, fleet, [fleet.gateway])
        for i, mode in ((1, "closed"), (2, "open")):
            gateway = ServiceProcess(f"gateway-{i}", ["gateway", "--host", "127.0.0.1", "--port", "0", "--router",
                                                      fleet.router_address, "--redis-url", redis.url,
                                                      "--redis-fail-mode", mode, *gateway_args],
                                     state_dir / "logs" / f"gateway-{i}.log", state_dir / "ports" / f"gateway-{i}.port")
            gateway.start()
            gateway.wait_port(60)
            harness.gateways.append(gateway)
        for url in harness.urls:
            wait_for(lambda url=url: _ready(url), 60, f"{url} ready")
        return harness
    except BaseException:
        fleet.stop()
        redis.stop()
        raise


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.05)
