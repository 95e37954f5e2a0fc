"""A fixed-batch fleet for tests and the benchmark: router(s), simulated (or engine) fixed-batch workers and a
gateway as real processes on loopback (tests/support/fleet.py's start_service), keys in a keys file. With several
routers every worker registers with each and the gateway is given them all."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flotilla.fleet.process import ServiceProcess

from tests.support.fleet import healthy_worker_ids, num_healthy_workers, start_service, write_keys
from tests.support.waiting import wait_until

MODEL = "sim"
READY_TIMEOUT_S = 60.0


@dataclass
class BatchFleet:
    router: ServiceProcess
    gateway: ServiceProcess
    workers: list[ServiceProcess] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)  # key id -> API key
    routers: list[ServiceProcess] = field(default_factory=list)  # router is routers[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def headers(self, key_id: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[key_id]}"}

    def healthy_worker_ids(self) -> set[str]:
        return healthy_worker_ids(self.router.address)

    def stop(self) -> None:
        for process in (self.gateway, *self.workers, *self.routers):
            process.stop()

    def __enter__(self) -> BatchFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_batch_fleet(state_dir: Path, num_workers: int = 2, worker_args: tuple[str, ...] = (),
                      router_args: tuple[str, ...] = (), keys: dict[str, tuple[str, str]] | None = None,
                      model: str = MODEL, num_routers: int = 1) -> BatchFleet:
    keys = keys or {"paid": ("acme", "paid"), "free": ("freeloader", "free")}
    keys_file = Path(state_dir) / "keys.json"
    api_keys = write_keys(keys_file, keys)
    routers = [start_service(state_dir, name, "router", "--host", "127.0.0.1", "--port", "0", *router_args)
               for name in (["router"] if num_routers == 1 else [f"router-{i}" for i in range(num_routers)])]
    addresses = ",".join(router.address for router in routers)
    fleet = BatchFleet(routers[0], None, keys=api_keys, routers=routers)  # type: ignore[arg-type]
    try:
        for i in range(num_workers):
            fleet.workers.append(start_service(
                state_dir, f"worker-{i}", "worker", "--backend", "fixed-batch", "--model-name", model,
                "--worker-id", f"w{i}", "--router", addresses, *worker_args, wait=False))
        fleet.gateway = start_service(state_dir, "gateway", "gateway", "--router", addresses, "--host",
                                      "127.0.0.1", "--port", "0", "--keys-file", str(keys_file))
        for worker in fleet.workers:
            worker.wait_port(READY_TIMEOUT_S)
        for router in routers:
            wait_until(lambda: num_healthy_workers(router.address) == num_workers, READY_TIMEOUT_S,
                       f"{num_workers} fixed-batch workers registered with {router.name}", interval_s=0.05)
        wait_until(lambda: httpx.get(f"{fleet.url}/healthz", timeout=2).status_code == 200, READY_TIMEOUT_S,
                   "the gateway", interval_s=0.05, ignore=(httpx.HTTPError,))
    except BaseException:
        fleet.stop() if fleet.gateway is not None else [p.stop() for p in (*fleet.workers, *routers)]
        raise
    return fleet
