"""The real fleet for tests: the one harness of the suites that start the services as processes on loopback.

`start_fleet(fleet_config(...), ...)` starts the router(s), workers and gateway with flotilla.fleet.local.LocalFleet
(the code behind `flotilla up`) and adds what the suites need around it: API keys in a keys file or in Redis,
more gateways on the same router, an OTLP receiver for the processes' traces, and a wait until every worker
has registered. `start_service(...)` starts one service on its own (a router without workers, workers with
flags of their own). What a test reads the fleet through (the router's ListWorkers, a worker's GetLoad, a
/metrics page) are plain functions of an address, for tests that drive a LocalFleet directly.

    with start_fleet(fleet_config(tiny_checkpoint, state_dir), keys={"k-paid": ("acme", "paid")}) as fleet:
        httpx.post(f"{fleet.url}/v1/completions", headers=fleet.headers, json=...)
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from flotilla.api.common.v1 import common_pb2
from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.api.worker.v1 import worker_pb2, worker_pb2_grpc
from flotilla.fleet.local import START_TIMEOUT_S, FleetConfig, LocalFleet
from flotilla.fleet.process import ServiceProcess
from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file
from flotilla.usage.record import UsageRecord

from tests.support.otlp_receiver import OTLPReceiver
from tests.support.redis_server import RedisServer
from tests.support.tls import channel, session_ca, tls_args
from tests.support.waiting import wait_until

MODEL = "flotilla-tiny"
NO_OUTPUT_CHECK = ("--output-check-interval-s", "0")
READY_TIMEOUT_S = 60.0  # a started fleet's workers to register, an extra gateway to serve


def fleet_config(checkpoint: Path, state_dir: Path, **fields) -> FleetConfig:
    """A LocalFleet config serving `checkpoint` as MODEL, its logs and ports under `state_dir`.

    The workers' golden-output check is off: its requests would move the engine counters that suites compare
    before and after (tests/worker/test_output_check.py and router_worker/test_output_health.py test it)."""
    fields["worker_args"] = [*NO_OUTPUT_CHECK, *fields.get("worker_args", [])]
    return FleetConfig(model_dir=checkpoint, state_dir=state_dir,
                       **{"model_name": MODEL, "ca": None if fields.get("insecure_internal") else session_ca(),
                          **fields})


@dataclass
class Fleet:
    """A running LocalFleet and what start_fleet set up around it; stop() (or `with`) stops all of it."""

    fleet: LocalFleet
    keys: dict[str, str] = field(default_factory=dict)  # key id -> API key
    redis: RedisServer | None = None  # where keys, quotas and the usage ledger live, when used
    gateways: list[ServiceProcess] = field(default_factory=list)  # [0] is the fleet's own
    spans: OTLPReceiver | None = None  # what the processes exported over OTLP, when asked for

    @property
    def url(self) -> str:
        return self.fleet.gateway_url

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{gateway.port}" for gateway in self.gateways]

    @property
    def model(self) -> str:
        return self.fleet.model_name

    @property
    def state_dir(self) -> Path:
        return Path(self.fleet.config.state_dir)

    @property
    def api_key(self) -> str:
        """The first key (the only one in most suites)."""
        return next(iter(self.keys.values()))

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    def create_key(self, tenant: str, *flags: str, key_id: str | None = None) -> str:
        """`flotilla keys create` against the fleet's Redis, as a real command; returns the key it printed."""
        key_flags = ["--key-id", key_id] if key_id else []
        key = create_redis_key(self.redis.url, tenant, *key_flags, *flags)
        if key_id:
            self.keys[key_id] = key
        return key

    def keys_command(self, *args: str) -> int:
        """`flotilla keys ARGS` against the fleet's Redis; its exit status."""
        return subprocess.run([sys.executable, "-m", "flotilla.cli", "keys", *args, "--redis-url", self.redis.url],
                              capture_output=True, text=True).returncode

    def add_gateway(self, *args: str) -> ServiceProcess:
        """One more gateway process on the fleet's router (the fleet's auth, then `args`), once it serves."""
        name = f"gateway-{len(self.gateways)}"
        gateway = _service(self.state_dir, name, ["gateway", "--host", "127.0.0.1", "--port", "0", "--router",
                                                  ",".join(self.fleet.router_addresses), *self._auth_args(),
                                                  *self.fleet.certs.args("gateway", name), *args])
        gateway.start()
        self.gateways.append(gateway)
        gateway.wait_port(READY_TIMEOUT_S)
        wait_gateway_ready(f"http://127.0.0.1:{gateway.port}")
        return gateway

    def _auth_args(self) -> list[str]:
        config = self.fleet.config
        if config.redis_url:
            return ["--redis-url", config.redis_url]
        return ["--keys-file", str(config.keys_file)] if config.keys_file else ["--no-auth"]

    def restart_gateway(self) -> None:
        """kill -9 of the fleet's gateway, then the same gateway again on the same port."""
        gateway = self.fleet.gateway
        gateway.args[gateway.args.index("--port") + 1] = str(gateway.port)  # where its clients retry
        gateway.kill()
        gateway.start()
        gateway.wait_port(READY_TIMEOUT_S)
        self.fleet.wait_ready(READY_TIMEOUT_S)

    def router_workers(self) -> dict[str, router_pb2.WorkerStatus]:
        return router_workers(self.fleet.router_address)

    def healthy_worker_ids(self) -> set[str]:
        return healthy_worker_ids(self.fleet.router_address)

    def num_healthy_workers(self) -> int:
        return num_healthy_workers(self.fleet.router_address)

    def worker_load(self, index: int = 0) -> common_pb2.LoadReport:
        return worker_load(self.fleet.workers[index])

    def metric_samples(self, service: str) -> list[Sample]:
        """Every sample on the /metrics page of a service ("gateway", "router", "worker-0", "autoscaler")."""
        return metric_samples(self.fleet.metrics_targets()[service])

    def ledger(self) -> list[UsageRecord]:
        """The final usage records in the fleet's Redis (not the checkpoints of running requests; duplicates of a
        request's final record would show here: summary.unique is what bills once)."""
        import redis

        from flotilla.usage.record import STATUS_OPEN
        from flotilla.usage.sinks import read_redis

        with redis.Redis.from_url(self.redis.url) as client:
            return [record for record in read_redis(client) if record.status != STATUS_OPEN]

    def wait_ledger(self, count: int, timeout_s: float = 30.0) -> list[UsageRecord]:
        wait_until(lambda: len(self.ledger()) >= count, timeout_s, f"{count} usage records", interval_s=0.05)
        return self.ledger()

    def stop(self) -> None:
        for gateway in self.gateways[1:]:
            gateway.stop()
        self.fleet.stop()
        if self.spans is not None:
            self.spans.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_fleet(config: FleetConfig, keys: dict[str, tuple[str, str]] | None = None,
                redis: RedisServer | None = None, gateways: list[list[str]] = (), otlp: bool = False) -> Fleet:
    """Start `config`'s fleet and return once every gateway serves and every worker has registered.

    keys: key id -> (tenant, tier), written to a keys file the gateways authenticate with.
    redis: keys and quotas in this Redis instead (Fleet.create_key adds keys); the usage ledger goes there.
    gateways: more gateways on the same router, one list of extra flags each.
    otlp: the processes export their traces to Fleet.spans.
    """
    fleet = Fleet(LocalFleet(config), redis=redis)
    if keys:
        config.keys_file = Path(config.state_dir) / "keys.json"
        fleet.keys = write_keys(config.keys_file, keys)
    if redis is not None:
        config.redis_url = redis.url
    if otlp:
        fleet.spans = OTLPReceiver().start()
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": fleet.spans.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        config.env = {**config.env, **otel}
    try:
        fleet.fleet.start()
        fleet.gateways.append(fleet.fleet.gateway)
        for args in gateways:
            fleet.add_gateway(*args)
        num_workers = (config.num_workers + config.num_prefill_workers + config.num_decode_workers
                       + config.num_long_context_workers)
        for address in fleet.fleet.router_addresses:  # every worker registers with every router
            wait_until(lambda: num_healthy_workers(address) >= num_workers, READY_TIMEOUT_S,
                       f"{num_workers} workers registered with {address}", interval_s=0.05)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def write_keys(path: Path, keys: dict[str, tuple[str, str]]) -> dict[str, str]:
    """A keys file with a new API key per key id -> (tenant, tier); returns key id -> API key."""
    api_keys = {key_id: generate_key() for key_id in keys}
    write_keys_file(path, [KeyEntry(key_id, hash_key(api_keys[key_id]), tenant, tier)
                           for key_id, (tenant, tier) in keys.items()])
    return api_keys


def create_redis_key(redis_url: str, tenant: str, *flags: str) -> str:
    """`flotilla keys create` as a real command; returns the key it printed."""
    out = subprocess.run([sys.executable, "-m", "flotilla.cli", "keys", "create", "--redis-url", redis_url,
                          "--tenant", tenant, *flags], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def start_service(state_dir: Path, name: str, *args: str, wait: bool = True) -> ServiceProcess:
    """One service (`flotilla ARGS`) as a process, its log and port file under `state_dir` as LocalFleet lays them
    out; with `wait`, once it wrote its port (then `.address` is where it serves). A router, worker or gateway
    gets a certificate from the session CA (its role, `name`) unless ARGS say --insecure-internal or --tls-dir."""
    args = list(args)
    if args[0] in ("router", "worker", "gateway") and not {"--insecure-internal", "--tls-dir"} & set(args):
        args += tls_args(args[0], name)
    process = _service(state_dir, name, args)
    process.start()
    if wait:
        process.wait_port(START_TIMEOUT_S)
    return process


def _service(state_dir: Path, name: str, args: list[str]) -> ServiceProcess:
    state_dir = Path(state_dir)
    return ServiceProcess(name, args, state_dir / "logs" / f"{name}.log", state_dir / "ports" / f"{name}.port")


def wait_gateway_ready(url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    wait_until(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, timeout_s, f"{url} ready",
               interval_s=0.05, ignore=(httpx.HTTPError,))


def router_workers(router_address: str, router_channel: grpc.Channel | None = None
                   ) -> dict[str, router_pb2.WorkerStatus]:
    """The router's ListWorkers, by worker id (as an operator of the session CA, unless `router_channel`)."""
    with router_channel or channel(router_address) as router:
        response = router_pb2_grpc.RouterServiceStub(router).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {status.worker.worker_id: status for status in response.workers}


def healthy_worker_ids(router_address: str) -> set[str]:
    return {worker_id for worker_id, status in router_workers(router_address).items() if status.healthy}


def num_healthy_workers(router_address: str) -> int:
    return len(healthy_worker_ids(router_address))


def worker_load(worker: ServiceProcess) -> common_pb2.LoadReport:
    """The worker's own GetLoad (not the router's last report of it)."""
    with channel(worker.address, "worker") as worker_channel:
        return worker_pb2_grpc.WorkerServiceStub(worker_channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def metric_samples(target: str) -> list[Sample]:
    """Every sample of the Prometheus /metrics page at host:port."""
    text = httpx.get(f"http://{target}/metrics", timeout=10).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
