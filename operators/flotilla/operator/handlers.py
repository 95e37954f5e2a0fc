"""kopf handlers for FlotillaPool: flat functions that take what they need; registered on a registry so
tests run the real operator with their own settings.

- create/update/resume: the Deployment and the headless Service exist and match the spec (create-or-patch:
  idempotent, no resourceVersion needed); replicas start at min + warm and are then owned by the timer.
- timer: rescale from the router's signals with the control law and write the status.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import kopf
from prometheus_client import CollectorRegistry

from flotilla.autoscaling.router_client import RouterClient
from flotilla.observability.autoscaler import AutoscalerMetrics
from flotilla.observability.exposition import serve_metrics
from flotilla.operator import gaie, manifests
from flotilla.operator.config import OperatorConfig
from flotilla.operator.kube import Kube, api_client
from flotilla.operator.model_route_handlers import register_model_route_handlers
from flotilla.operator.pool_spec import GROUP, PLURAL, VERSION, InvalidPoolSpec, PoolSpec, parse_spec
from flotilla.operator.ratio import decode_replicas, total_decode_replicas
from flotilla.operator.scaler import rescale


def register_handlers(registry: kopf.OperatorRegistry, config: OperatorConfig) -> AutoscalerMetrics:
    """-> the autoscaler gauges the timer sets (served on config.metrics_port when given)."""
    kube = Kube(api_client(config.kube_host))
    metrics_registry = CollectorRegistry()
    metrics = AutoscalerMetrics.create(metrics_registry)
    if config.metrics_port is not None:
        serve_metrics(metrics_registry, "0.0.0.0", config.metrics_port)  # scraped from inside the cluster
    routers: dict[str, RouterClient] = {}
    router_tls = config.router_tls()  # None: --insecure-internal (warned); neither: exits here, at start
    register_model_route_handlers(registry, config, router_tls)  # FlotillaModelRoute (model_route.py)

    def router_for(spec: PoolSpec) -> RouterClient | None:
        address = spec.router_address or config.router_address
        if not address:
            return None
        if address not in routers:
            routers[address] = RouterClient(address, router_tls)
        return routers[address]

    def gaie_enabled() -> bool:
        """mode on: always; auto: when the GAIE CRD is served (asked at each reconcile: it may be installed later)."""
        if config.gateway.mode == "auto":
            return kube.serves(gaie.GROUP, gaie.VERSION, gaie.PLURAL)
        return config.gateway.mode == "on"

    if config.kube_host:
        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=config.kube_host)

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    def reconcile(body: kopf.Body, spec: kopf.Spec, patch: kopf.Patch, logger, **_: Any) -> None:
        pool = _parse(spec)
        raw = _raw(body)
        meta = raw["metadata"]
        refused = config.pod_policy.violations(pool)
        if refused:  # nothing is created or changed; the status and an error event say why
            patch.status["refused"] = "; ".join(refused)
            logger.error("FlotillaPool %s refused: %s", meta["name"], "; ".join(refused))
            return
        patch.status["refused"] = None
        existing = kube.read_deployment(meta["namespace"], manifests.worker_name(meta["name"]))
        initial = pool.policy.min_replicas + pool.policy.warm_replicas
        address = pool.router_address or config.router_address
        manifest = manifests.deployment(raw, pool, initial, address, config.worker_tls_secret_of(pool),
                                        config.worker_lease_secret)
        kube.apply_deployment(manifest, keep_replicas=existing is not None)
        kube.apply_service(manifests.service(raw, pool))
        if pool.role in gaie.SERVING_ROLES and gaie_enabled():
            kube.apply_custom(gaie.GROUP, gaie.VERSION, gaie.PLURAL, gaie.inference_pool(raw, pool, config.gateway))
        if existing is None:
            patch.status["desiredReplicas"] = initial
            patch.status["lastDecision"] = {"reason": f"created with min {pool.policy.min_replicas} + "
                                                      f"warm {pool.policy.warm_replicas} replicas"}
        logger.info("FlotillaPool %s reconciled", meta["name"])

    @kopf.index(GROUP, VERSION, PLURAL, id="decode_pools", registry=registry)  # id: the kwarg name
    def decode_pools(namespace: str, spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict | None:
        """(namespace, model) -> each decode pool's size: the prefill pool's ratio floor scales from it."""
        if spec.get("role") != "decode" or "name" not in spec.get("model", {}):
            return None
        return {(namespace, spec["model"]["name"]): decode_replicas(dict(status))}

    @kopf.timer(GROUP, VERSION, PLURAL, interval=config.interval_s, registry=registry)
    def rescale_pool(body: kopf.Body, spec: kopf.Spec, status: kopf.Status, patch: kopf.Patch, logger,
                     decode_pools: kopf.Index, **_: Any) -> None:
        pool = _parse(spec)
        meta = _raw(body)["metadata"]
        name = manifests.worker_name(meta["name"])
        deployment = kube.read_deployment(meta["namespace"], name)
        if deployment is None:
            return  # the create handler has not run yet
        router = router_for(pool)
        if router is None:
            return  # no signals: the pool stays at min + warm
        current = deployment["spec"]["replicas"] or 0
        try:
            num_decode = total_decode_replicas(decode_pools.get((meta["namespace"], pool.model.name), []))
            result = rescale(pool, dict(status), router, current, time.time(), num_decode)
        except grpc.RpcError as error:
            raise kopf.TemporaryError(f"router unreachable: {error.code()}", delay=config.interval_s)
        for worker_id in result.drained:  # drained: let the ReplicaSet remove exactly these pods first
            kube.annotate_pod(meta["namespace"], worker_id, manifests.DELETION_COST_ANNOTATION,
                              manifests.DRAINED_DELETION_COST)
        for worker_id in result.reactivated:  # serving again: not the first pod to go any more
            kube.annotate_pod(meta["namespace"], worker_id, manifests.DELETION_COST_ANNOTATION, None)
        if result.replicas != current:
            kube.scale_deployment(meta["namespace"], name, result.replicas)
            logger.info("FlotillaPool %s: %d -> %d replicas: %s", meta["name"], current, result.replicas,
                        result.decision.reason)
        ready = (deployment.get("status") or {}).get("ready_replicas") or 0
        for key, value in result.status(ready).items():
            patch.status[key] = value
        metrics.set(meta["name"], pool.model.name, pool.role, desired=result.replicas, actual=ready,
                    active=result.signals.num_active, warm=result.signals.num_warm)

    return metrics


def _parse(spec: kopf.Spec) -> PoolSpec:
    try:
        return parse_spec(dict(spec))
    except InvalidPoolSpec as error:
        raise kopf.PermanentError(str(error)) from None


def _raw(body: kopf.Body) -> dict[str, Any]:
    return {"metadata": {"name": body.metadata.name, "namespace": body.metadata.namespace,
                         "uid": body.metadata.uid, "labels": dict(body.metadata.labels)}}
