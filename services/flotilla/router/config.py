"""Router settings (flags of `flotilla router`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flotilla.router.auto_rollback import AutoRollbackRule
from flotilla.router.batch_dispatcher import BatchSettings
from flotilla.router.placement import PlacementLimits
from flotilla.rpc.tls import InternalTLS


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, announced on stdout and in port_file
    port_file: str | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> name or name@version (initial ones)
    # Where the model registry (aliases, routes, rollouts) is kept across restarts; None: in memory only.
    model_routes_file: str | None = None
    auto_rollback: AutoRollbackRule = field(default_factory=AutoRollbackRule)  # off unless a bound is set
    model_names: tuple[str, ...] = ()  # models expected before any worker registers: their requests wait
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.0  # missing heartbeats this long: unhealthy, no new work
    evict_after_s: float = 60.0  # silent this long: forgotten
    max_queue_depth: int = 1024  # per model; beyond: OVERLOADED at once
    max_queue_wait_s: float = 30.0  # a queued request gives up after this (or its deadline)
    cold_start_wait_s: float | None = None  # the same for a model with no active replica; None: max_queue_wait_s
    shared_load_timeout_s: float = 600.0  # longest a shared-pool worker's LoadModel may take (shared_pool.py)
    limits: PlacementLimits = field(default_factory=PlacementLimits)
    batch: BatchSettings = field(default_factory=BatchSettings)  # fixed-batch models (batch_dispatcher.py)
    shutdown_grace_s: float = 5.0
    metrics_port: int | None = None  # Prometheus /metrics on host:port (0 = any free port); None = off
    metrics_port_file: str | None = None  # where the bound metrics port is written
    tls: InternalTLS | None = None  # mTLS for its server and its channels to workers; None: insecure
    # Placement leases (lease_service.py): the secret its workers share (rpc/leases.py); None: no leases,
    # gateways stream through the router. A lease's token is valid this long after the grant.
    lease_secret_file: str | None = None
    lease_ttl_s: float = 30.0

    def validate(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if self.max_queue_depth < 0 or self.max_queue_wait_s < 0:
            raise ValueError("max_queue_depth and max_queue_wait_s must be >= 0")
        if self.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be > 0")
        for alias, target in self.aliases.items():
            if not alias or not target or alias == target:
                raise ValueError(f"bad alias {alias!r} -> {target!r}")
