"""Autoscaler metrics (desired vs actual replicas per pool, and the active/warm split); the local supervisor
(`flotilla up --autoscale`) sets them on each tick and the operator on each rescale.

desired: replicas the control law wants (active + warm); actual: replicas up now (the local supervisor: the
router's active + warm workers; the operator: the Deployment's ready pods); active/warm: the router's view."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge


@dataclass
class AutoscalerMetrics:
    desired_replicas: Gauge
    actual_replicas: Gauge
    active_replicas: Gauge
    warm_replicas: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AutoscalerMetrics:
        labels = ["pool", "model", "role"]
        return cls(
            desired_replicas=Gauge("flotilla_autoscaler_desired_replicas", "Replicas the control law wants",
                                   labels, registry=registry),
            actual_replicas=Gauge("flotilla_autoscaler_actual_replicas", "Replicas serving now", labels,
                                  registry=registry),
            active_replicas=Gauge("flotilla_autoscaler_active_replicas", "Replicas in the router's rotation",
                                  labels, registry=registry),
            warm_replicas=Gauge("flotilla_autoscaler_warm_replicas", "Replicas loaded, out of rotation", labels,
                                registry=registry),
        )

    def set(self, pool: str, model: str, role: str, desired: int, actual: int,
            active: int | None = None, warm: int | None = None) -> None:
        self.desired_replicas.labels(pool, model, role).set(desired)
        self.actual_replicas.labels(pool, model, role).set(actual)
        if active is not None:
            self.active_replicas.labels(pool, model, role).set(active)
        if warm is not None:
            self.warm_replicas.labels(pool, model, role).set(warm)
