"""Gateway settings: everything the HTTP front door needs to start, fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flotilla.rpc.tls import InternalTLS
from flotilla.gateway.batch_jobs.settings import BatchSettings
from flotilla.gateway.degradation import DegradationPolicy
from flotilla.tenancy.admission_policy import AdmissionPolicy

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # tool_parsers.SYNTAXES, and auto


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port, announced on stdout and in port_file
    port_file: str | None = None
    # Every router (host:port); each model's requests go to one of them, failing over to the next (router_pool.py).
    router_addresses: tuple[str, ...] = ("127.0.0.1:50051",)
    keys_file: Path | None = None  # None: authentication disabled (local runs only)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_model: str | None = None  # used when a request names no model
    model_refresh_s: float = 10.0  # how often the model list is re-read from the router
    min_refresh_gap_s: float = 1.0  # unknown-model refreshes are throttled to one per gap
    retry_after_s: int = 1  # Retry-After on 503/529 answers
    router_timeout_s: float = 5.0  # unary router calls (ListModels)
    redis_url: str | None = None  # keys and quotas in Redis (shared by every gateway); else keys_file + local
    redis_fail_mode: str = "closed"  # Redis down: "closed" answers 503, "open" goes on with local limits
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)  # wait budgets, deadlines, weights
    degradation: DegradationPolicy = field(default_factory=DegradationPolicy)  # free tier under load
    # Fault tolerance: the usage ledger goes to Redis (redis_url) or else to this JSON-lines file (None: off
    # without Redis); Idempotency-Key responses are kept this long; a resumable stream waits this long for
    # its client to reconnect.
    usage_log: Path | None = None
    usage_checkpoint_s: float = 1.0  # a running stream's ledger checkpoint period (usage_meter.py)
    idempotency_ttl_s: float = 24 * 3600.0
    stream_resume_grace_s: float = 30.0
    tool_call_parser: str = "auto"  # how models write tool calls: "auto" (from each chat template) or a syntax name
    router_tls: InternalTLS | None = None  # mTLS to the router and workers (the gateway's certificate); None: insecure
    # How token streams travel (router_client.py): "auto" straight from the workers under the router's placement
    # leases when it grants them, else relayed by the router; "direct" and "relay" force one.
    stream_path: str = "auto"
    # Connection hygiene (connection_limits.py): a client has header_timeout_s from connecting (on a kept-alive
    # connection, from its next request's first byte) to finish its request headers, body_timeout_s after them to
    # finish its body, and write_timeout_s to take a response's bytes once the buffers are full; else the
    # connection is aborted. Past max_connections open connections uvicorn answers a bare 503; past
    # max_concurrent_requests in flight, and past max_streams_per_key open streams of one key (per gateway
    # process), the gateway answers 503 / 429 in the dialect's shape.
    # An idle kept-alive connection is closed after keep_alive_s: longer than the pool expiry of httpx (5 s: the
    # openai and anthropic SDKs) and aiohttp (15 s), so that such a client drops a connection before the gateway
    # closes it and never reuses one in the instant it is closed. Behind a load balancer: above its idle timeout.
    keep_alive_s: float = 20.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 30.0  # a response whose client stopped reading (buffers full) is cut after this long
    # Each connection's kernel send buffer (SO_SNDBUF; Linux doubles it). Left to autotuning it grows to
    # tcp_wmem's maximum (4 MiB by default): a client that stops reading would pin that much kernel memory per
    # connection and take megabytes of tokens before its writes stall and write_timeout_s starts.
    send_buffer_bytes: int = 256 * 1024
    max_header_bytes: int = 16 * 1024
    max_connections: int = 4096
    max_concurrent_requests: int = 1024
    max_streams_per_key: int = 64
    # Prometheus /metrics on its own listener (host:metrics_port, 0 = any free port); None: not served. Never on
    # the public port: its labels name models, routes and tiers.
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: the public host
    metrics_port_file: str | None = None
    batch: BatchSettings = field(default_factory=BatchSettings)  # batch jobs (/v1/batches, /v1/messages/batches)
    safety_config: Path | None = None  # safety policies (JSON, safety/config.py); None: nothing is screened

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.model_refresh_s <= 0 or self.min_refresh_gap_s < 0:
            raise ValueError("model_refresh_s must be > 0 and min_refresh_gap_s >= 0")
        if self.redis_fail_mode not in ("open", "closed"):
            raise ValueError(f"redis_fail_mode must be 'open' or 'closed', got {self.redis_fail_mode!r}")
        if self.stream_path not in ("auto", "direct", "relay"):
            raise ValueError(f"stream_path must be auto, direct or relay, got {self.stream_path!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        for name in ("keep_alive_s", "header_timeout_s", "body_timeout_s", "write_timeout_s", "send_buffer_bytes",
                     "max_header_bytes", "max_connections", "max_concurrent_requests", "max_streams_per_key"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
