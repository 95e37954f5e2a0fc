"""Worker settings (flags of `flotilla worker`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.engine.config import EngineConfig
from flotilla.rpc.tls import InternalTLS
from flotilla.worker.kv_settings import DisaggSettings
from flotilla.worker.check_settings import CheckSettings


@dataclass
class WorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port, announced on stdout and in port_file
    port_file: str | None = None
    advertise_host: str | None = None  # the host the router dials; defaults to `host`
    worker_id: str = ""  # default: worker-<random>
    model_name: str = ""  # default: the checkpoint directory's name
    routers: tuple[str, ...] = ()  # host:port of every router to register with; none: serve alone, unregistered
    heartbeat_interval_s: float = 0.25  # until the router says otherwise
    shutdown_grace_s: float = 5.0  # streams still running after this are aborted
    # Release running requests' tokens at the first step this long after the previous release, the same step
    # for all (one message per release per hop; engine/stream_pacer.py). 0: each token as soon as it is ready.
    stream_interval_s: float = 0.0
    pool: str = ""  # the router pool it registers in: "" (default) or "long-context" (router/context_pools.py)
    disagg: DisaggSettings = field(default_factory=DisaggSettings)  # role and KV hand-off settings
    metrics_port: int | None = None  # Prometheus /metrics on host:port (0 = any free port); None = off
    metrics_port_file: str | None = None  # where the bound metrics port is written
    output_check: CheckSettings = field(default_factory=CheckSettings)  # golden-output health (output_check.py)
    tls: InternalTLS | None = None  # mTLS for its server and its channels (router, KV peers); None: insecure
    # A shared-pool worker (shared_server.py): (name, checkpoint dir) of every model it may load on demand, and
    # how many it holds loaded at once (the least recently used is unloaded for another). Empty: one model.
    shared_models: tuple[tuple[str, str], ...] = ()
    max_loaded_models: int = 1
    # The router's lease secret (rpc/leases.py): every Generate stream must carry a valid lease for this
    # worker. None: no lease is checked and only the router may open streams (it relays them).
    lease_secret_file: str | None = None
    # The engine in a child process (engine/process_engine.py) instead of a thread beside the gRPC loop: the
    # two stop sharing a GIL, so a core pinned to the engine is the engine's alone. Role both, one model.
    engine_process: bool = False

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"worker-{uuid.uuid4().hex[:8]}"

    def resolved_model_name(self) -> str:
        return self.model_name or Path(self.engine.model_dir).resolve().name
