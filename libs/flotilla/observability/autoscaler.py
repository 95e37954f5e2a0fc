"""Autoscaler metrics (desired vs actual replicas per pool); the autoscaler sets them on each reconcile."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge


@dataclass
class AutoscalerMetrics:
    desired_replicas: Gauge
    actual_replicas: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AutoscalerMetrics:
        labels = ["pool", "model", "role"]
        return cls(
            desired_replicas=Gauge("flotilla_autoscaler_desired_replicas", "Replicas the control law wants",
                                   labels, registry=registry),
            actual_replicas=Gauge("flotilla_autoscaler_actual_replicas", "Replicas serving now", labels,
                                  registry=registry),
        )

    def set(self, pool: str, model: str, role: str, desired: int, actual: int) -> None:
        self.desired_replicas.labels(pool, model, role).set(desired)
        self.actual_replicas.labels(pool, model, role).set(actual)
