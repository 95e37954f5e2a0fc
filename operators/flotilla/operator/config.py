"""Operator settings, from the environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    router_address: str = ""  # default router for pools without spec.routerAddress; "" : no autoscaling
    interval_s: float = 10.0  # how often each pool is rescaled from its signals
    kube_host: str | None = None  # API server URL without credentials (tests); None: in-cluster/kubeconfig
    metrics_port: int | None = None  # serve the autoscaler gauges on /metrics here (0: any free port)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("interval_s must be > 0")

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            router_address=os.environ.get("FLOTILLA_ROUTER_ADDRESS", ""),
            interval_s=float(os.environ.get("FLOTILLA_OPERATOR_INTERVAL_S", "10")),
            kube_host=os.environ.get("FLOTILLA_KUBE_HOST") or None,
            metrics_port=int(os.environ["FLOTILLA_OPERATOR_METRICS_PORT"])
            if os.environ.get("FLOTILLA_OPERATOR_METRICS_PORT") else None,
        )
