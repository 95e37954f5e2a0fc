"""The whole fleet on one machine: router(s), workers and gateway as separate processes on loopback. With several
routers every worker registers with each and the gateway is given them all (gateway/router_pool.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from flotilla.fleet.certs import FleetCerts
from flotilla.fleet.process import ProcessFailed, ServiceProcess

if TYPE_CHECKING:
    from flotilla.autoscaling.policy import PoolPolicy
    from flotilla.autoscaler.supervisor import LocalSupervisor
    from flotilla.rpc.certs import CertificateAuthority
    from flotilla.observability.exposition import MetricsServer
from flotilla.rpc.options import read_port_file

START_TIMEOUT_S = 180.0  # a worker loads weights and allocates its KV pool before it serves


@dataclass
class FleetConfig:
    model_dir: Path
    state_dir: Path  # logs, port files, keys
    model_name: str = ""  # default: the checkpoint directory's name
    host: str = "127.0.0.1"
    gateway_port: int = 0  # 0: any free port
    num_routers: int = 1  # more than one: named router-0, router-1, ...; else "router"
    num_workers: int = 1
    # Disaggregated serving: workers with role prefill / decode (KV over NIXL), in addition to num_workers.
    num_prefill_workers: int = 0
    num_decode_workers: int = 0
    # Long-context pool (router/context_pools.py): workers started with --pool long-context and these flags (their
    # own KV budget and --max-num-batched-tokens), and the router's threshold for the model (0: the router's own).
    num_long_context_workers: int = 0
    long_context_worker_args: list[str] = field(default_factory=list)
    long_context_threshold: int = 0
    keys_file: Path | None = None  # None: no authentication
    redis_url: str | None = None  # keys and quotas in Redis instead of keys_file (FLOTILLA_REDIS_URL)
    worker_args: list[str] = field(default_factory=list)  # extra `flotilla worker` flags
    router_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # None: a fixed set of num_workers workers. A policy: the local supervisor scales the workers between
    # its min and max and keeps its warm workers loaded out of rotation (num_workers start active).
    autoscale: PoolPolicy | None = None
    autoscale_interval_s: float = 0.1
    metrics: bool = True  # gateway, router and workers serve Prometheus /metrics on free ports (metrics_targets)
    # mTLS between the services, each with its own certificate from this CA (None: a throwaway CA kept in
    # <state_dir>/tls/ca); insecure_internal: plaintext, nobody authenticated (fleet/certs.py).
    ca: CertificateAuthority | None = None
    insecure_internal: bool = False
    # A shared pool for rarely used models (`flotilla worker --shared-models`): checkpoints as NAME=DIR or DIR,
    # served by shared_pool_workers workers that hold at most shared_pool_max_loaded of them loaded each.
    shared_pool_models: tuple[str, ...] = ()
    shared_pool_workers: int = 1
    shared_pool_max_loaded: int = 1
    # Placement leases: the router and workers share a secret (<state_dir>/lease-secret, made once), the
    # gateway streams from the workers. False: no secret, the router relays every stream.
    leases: bool = True


class LocalFleet:
    def __init__(self, config: FleetConfig):
        self.config = config
        self.routers: list[ServiceProcess] = []
        self.workers: list[ServiceProcess] = []
        self.shared_workers: list[ServiceProcess] = []  # the shared pool's (the autoscaler never scales them)
        self.gateway: ServiceProcess | None = None
        self.gateway_url = ""
        self._next_worker = 0
        # Held while the worker list changes (the autoscaler's thread) or is acted on (the restarting loop).
        self.lock = threading.RLock()
        self.supervisor: LocalSupervisor | None = None
        self._autoscaler_metrics: MetricsServer | None = None  # /metrics of the supervisor's gauges
        self.certs = FleetCerts(config.state_dir, config.ca, config.insecure_internal)

    @property
    def router(self) -> ServiceProcess | None:
        """The first router (the only one unless num_routers > 1)."""
        return self.routers[0] if self.routers else None

    @property
    def router_addresses(self) -> list[str]:
        """host:port of every router, in the order workers and the gateway are given them."""
        return [f"{self.config.host}:{router.port}" for router in self.routers]

    @property
    def router_address(self) -> str:
        return self.router_addresses[0] if self.routers else ""

    @property
    def model_name(self) -> str:
        return self.config.model_name or Path(self.config.model_dir).name

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalFleet:
        """Start every service and return once the gateway serves the model; stops all on failure."""
        try:
            self._start_routers(timeout_s)
            for _ in range(self.config.num_workers):
                self.start_worker(wait=False)
            for role, count in (("prefill", self.config.num_prefill_workers), ("decode", self.config.num_decode_workers)):
                for _ in range(count):
                    self.start_worker(wait=False, extra_args=["--role", role])
            for _ in range(self.config.num_long_context_workers):
                self.start_worker(wait=False, extra_args=["--pool", "long-context",
                                                          *self.config.long_context_worker_args])
            if self.config.shared_pool_models:
                for index in range(self.config.shared_pool_workers):
                    self._start_shared_worker(f"shared-{index}")
            for worker in [*self.workers, *self.shared_workers]:
                worker.wait_port(timeout_s)
            self._start_gateway(timeout_s)
            self.wait_ready(timeout_s)
            if self.config.autoscale is not None:
                self._start_supervisor()
        except BaseException:
            self.stop()
            raise
        return self

    def _service(self, name: str, args: list[str], keep_port: bool = False) -> ServiceProcess:
        state = Path(self.config.state_dir)
        return ServiceProcess(name, args, state / "logs" / f"{name}.log", state / "ports" / f"{name}.port",
                              dict(self.config.env), keep_port=keep_port)

    def _lease_args(self) -> list[str]:
        if not self.config.leases:
            return []
        from flotilla.rpc.leases import ensure_secret_file

        return ["--lease-secret-file", str(ensure_secret_file(Path(self.config.state_dir) / "lease-secret"))]

    def _start_routers(self, timeout_s: float) -> None:
        count = self.config.num_routers
        names = ["router"] if count == 1 else [f"router-{i}" for i in range(count)]
        threshold = self.config.long_context_threshold
        for name in names:
            args = ["router", "--host", self.config.host, "--model", self.model_name, *self._metrics_args(name),
                    *self.certs.args("router", name), *self._lease_args(),
                    *(["--long-context-threshold", f"{self.model_name}={threshold}"] if threshold else []),
                    *self.config.router_args]
            router = self._service(name, args, keep_port=True)  # workers and gateways dial this address
            router.start()
            self.routers.append(router)
        for router in self.routers:
            router.wait_port(timeout_s)

    def _start_supervisor(self) -> None:
        from flotilla.fleet.launcher import FleetLauncher
        from flotilla.autoscaling.router_client import RouterClient
        from flotilla.autoscaler.supervisor import LocalSupervisor, SupervisorConfig

        config = SupervisorConfig(self.model_name, self.config.autoscale, self.config.autoscale_interval_s)
        router = RouterClient(self.router_addresses, self.certs.client("operator", "autoscaler"))
        self.supervisor = LocalSupervisor(config, router, FleetLauncher(self))
        if self.config.metrics:  # the supervisor runs in this process: its gauges get their own /metrics
            self._serve_autoscaler_metrics(self.supervisor)
        self.supervisor.start()

    def _serve_autoscaler_metrics(self, supervisor: LocalSupervisor) -> None:
        from prometheus_client import CollectorRegistry

        from flotilla.observability.autoscaler import AutoscalerMetrics
        from flotilla.observability.exposition import serve_metrics

        registry = CollectorRegistry()
        supervisor.metrics = AutoscalerMetrics.create(registry)
        port_file = self._metrics_port_file("autoscaler")
        self._autoscaler_metrics = serve_metrics(registry, self.config.host, 0, str(port_file))

    def next_worker_id(self) -> str:
        return f"worker-{self._next_worker}"

    def retire_worker(self, name: str) -> ServiceProcess | None:
        """Forget a worker (the autoscaler stops it, and nothing restarts it); None when no such worker."""
        with self.lock:
            for worker in self.workers:
                if worker.name == name:
                    self.workers.remove(worker)
                    return worker
        return None

    def start_worker(self, wait: bool = True, extra_args: list[str] | None = None) -> ServiceProcess:
        with self.lock:
            name = self.next_worker_id()
            self._next_worker += 1
            args = [
                "worker", "--host", self.config.host, "--router", ",".join(self.router_addresses),
                "--worker-id", name,
                "--model-dir", str(self.config.model_dir), "--model-name", self.model_name,
                *self._metrics_args(name), *self.certs.args("worker", name), *self._lease_args(),
                *self.config.worker_args, *(extra_args or []),
            ]  # fmt: skip
            worker = self._service(name, args)
            worker.start()
            self.workers.append(worker)
        if wait:
            worker.wait_port(START_TIMEOUT_S)
        return worker

    def _start_shared_worker(self, name: str) -> None:
        args = [
            "worker", "--host", self.config.host, "--router", ",".join(self.router_addresses), "--worker-id", name,
            "--shared-models", ",".join(self.config.shared_pool_models),
            "--max-loaded-models", str(self.config.shared_pool_max_loaded),
            *self._metrics_args(name), *self.certs.args("worker", name), *self._lease_args(), *self.config.worker_args,
        ]  # fmt: skip
        worker = self._service(name, args)
        worker.start()
        self.shared_workers.append(worker)

    def _start_gateway(self, timeout_s: float) -> None:
        auth = ["--keys-file", str(self.config.keys_file)] if self.config.keys_file else ["--no-auth"]
        if self.config.redis_url:
            auth = ["--redis-url", self.config.redis_url]
        args = [
            "gateway", "--host", self.config.host, "--port", str(self.config.gateway_port),
            "--router", ",".join(self.router_addresses), *auth, *self.certs.args("gateway", "gateway"),
            *self._metrics_args("gateway"),
            *self.config.gateway_args,
        ]  # fmt: skip
        self.gateway = self._service("gateway", args, keep_port=True)  # clients do
        self.gateway.start()
        self.gateway_url = f"http://{self.config.host}:{self.gateway.wait_port(timeout_s)}"

    def _metrics_port_file(self, name: str) -> Path:
        return Path(self.config.state_dir) / "ports" / f"{name}.metrics.port"

    def _metrics_args(self, name: str) -> list[str]:
        if not self.config.metrics:
            return []
        port_file = self._metrics_port_file(name)
        port_file.unlink(missing_ok=True)
        return ["--metrics-port", "0", "--metrics-port-file", str(port_file)]

    def metrics_targets(self) -> dict[str, str]:
        """host:port of every running service's /metrics endpoint, by service name (each on the metrics port it
        wrote once serving; the gateway's is not its public port)."""
        targets = {}
        if self._autoscaler_metrics is not None:
            targets["autoscaler"] = f"{self.config.host}:{self._autoscaler_metrics.port}"
        for service in [self.gateway, *self.routers, *self.workers, *self.shared_workers]:
            port = read_port_file(self._metrics_port_file(service.name)) if service is not None else None
            if port is not None and service.is_running():
                targets[service.name] = f"{self.config.host}:{port}"
        return targets

    def wait_ready(self, timeout_s: float) -> None:
        """Until /readyz says the router is reachable and serves a model."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for service in self.services():
                if not service.is_running():
                    raise ProcessFailed(f"{service.name} exited:\n{service.log_tail()}")
            try:
                if httpx.get(f"{self.gateway_url}/readyz", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ProcessFailed(f"fleet not ready within {timeout_s:.0f} s:\n{self.gateway.log_tail()}")

    def services(self) -> list[ServiceProcess]:
        with self.lock:
            return [s for s in [self.gateway, *self.workers, *self.shared_workers, *self.routers] if s is not None]

    def stop(self) -> None:
        """Front to back: the gateway stops taking requests first, the routers last."""
        if self.supervisor is not None:
            self.supervisor.stop()  # no scaling while the fleet goes down
            self.supervisor = None
        if self._autoscaler_metrics is not None:
            self._autoscaler_metrics.stop()
            self._autoscaler_metrics = None
        for service in self.services():
            service.stop()

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
