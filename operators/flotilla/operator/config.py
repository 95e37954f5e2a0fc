"""Operator settings, from the environment (the Helm chart sets them)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from flotilla.operator.gaie import GatewayTarget
from flotilla.operator.pod_policy import PodPolicy
from flotilla.operator.pool_spec import PoolSpec


@dataclass(frozen=True)
class OperatorConfig:
    router_address: str = ""  # default router for pools without spec.routerAddress; "" : no autoscaling
    interval_s: float = 10.0  # how often each pool is rescaled from its signals
    kube_host: str | None = None  # API server URL without credentials (tests); None: in-cluster/kubeconfig
    metrics_port: int | None = None  # serve the autoscaler gauges on /metrics here (0: any free port)
    gateway: GatewayTarget = field(default_factory=lambda: GatewayTarget(mode="off"))  # GAIE InferencePools
    pod_policy: PodPolicy = field(default_factory=PodPolicy)  # what pools may ask of their worker pods
    # mTLS: the operator's own certificate directory (it calls the router as an operator identity) and the
    # Secret its worker pods mount (a worker identity); or, explicitly, insecure_internal: plaintext for the
    # operator and its workers (--insecure-internal), with a warning.
    tls_dir: str = ""
    worker_tls_secret: str = ""
    insecure_internal: bool = False
    # Placement leases: the Secret (key `secret`) its worker pods mount for --lease-secret-file, the router's
    # signing secret, so gateways stream from them directly; "": the workers check no leases (router relays).
    worker_lease_secret: str = ""

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if self.tls_dir and not self.worker_tls_secret:
            raise ValueError("FLOTILLA_TLS_DIR needs FLOTILLA_WORKER_TLS_SECRET (the worker pods' certificate)")

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            router_address=os.environ.get("FLOTILLA_ROUTER_ADDRESS", ""),
            interval_s=float(os.environ.get("FLOTILLA_OPERATOR_INTERVAL_S", "10")),
            kube_host=os.environ.get("FLOTILLA_KUBE_HOST") or None,
            metrics_port=int(os.environ["FLOTILLA_OPERATOR_METRICS_PORT"])
            if os.environ.get("FLOTILLA_OPERATOR_METRICS_PORT") else None,
            gateway=_gateway_from_env(),
            pod_policy=PodPolicy.from_env(),
            tls_dir=os.environ.get("FLOTILLA_TLS_DIR", ""),
            worker_tls_secret=os.environ.get("FLOTILLA_WORKER_TLS_SECRET", ""),
            insecure_internal=os.environ.get("FLOTILLA_INSECURE_INTERNAL", "").lower() in ("1", "true", "yes"),
            worker_lease_secret=os.environ.get("FLOTILLA_WORKER_LEASE_SECRET", ""),
        )

    def worker_tls_secret_of(self, pool: PoolSpec) -> str:
        """The Secret a pool's worker pods mount: its own (spec.worker.tlsSecret, one identity per pool) or the
        default; "" (plaintext workers) when the operator runs insecure."""
        if not self.worker_tls_secret:
            return ""
        return pool.worker.tls_secret or self.worker_tls_secret

    def router_tls(self):
        """The operator's InternalTLS for router calls; None for insecure_internal (warned). Exits when neither
        a tls_dir nor insecure_internal was given."""
        from flotilla.rpc.tls import from_flags

        return from_flags(self.tls_dir or None, self.insecure_internal, "operator")


def _gateway_from_env() -> GatewayTarget:
    """FLOTILLA_GATEWAY_SELECTOR (JSON labels of the gateway pods), FLOTILLA_GATEWAY_PORT, FLOTILLA_GAIE_INFERENCE_POOL
    (auto, on, off; default auto with a selector, else off), FLOTILLA_GAIE_ENDPOINT_PICKER (name:port)."""
    selector = json.loads(os.environ.get("FLOTILLA_GATEWAY_SELECTOR") or "{}")
    return GatewayTarget(selector=selector, port=int(os.environ.get("FLOTILLA_GATEWAY_PORT", "8080")),
                         endpoint_picker=os.environ.get("FLOTILLA_GAIE_ENDPOINT_PICKER", ""),
                         mode=os.environ.get("FLOTILLA_GAIE_INFERENCE_POOL") or ("auto" if selector else "off"))
