"""A long-context FlotillaPool (`pool: long-context`) against kmock and a real router: the operator scales it on its
own pool's signals (its workers' queued tokens), not on the default pool's load, and never steers the default
pool's workers of the same model and role."""

from __future__ import annotations

import asyncio

import kmock
import kopf

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers

from tests.support.waiting import async_wait_until
from .kopf_run import start_operator
from .test_operator_kmock import OPERATOR_TLS, _get

POOL = {
    "apiVersion": "flotilla.dev/v1alpha1",
    "kind": "FlotillaPool",
    "metadata": {"name": "tiny-long", "namespace": "ns1", "uid": "uid-tiny-long", "resourceVersion": "1"},
    "spec": {
        "model": {"name": "tiny", "version": "v1", "checkpoint": "/models/tiny"},
        "role": "both",
        "pool": "long-context",
        "replicas": {"min": 1, "max": 4, "warm": 0},
        "targets": {"queuedTokensPerReplica": 1000, "kvUtilisation": 0.8, "ttftP95Seconds": 30},
        "scaling": {"scaleUpCooldownSeconds": 0, "scaleDownCooldownSeconds": 600, "signalsWindowSeconds": 30},
        "worker": {"image": "ghcr.io/flotilla/worker:0.1.0"},
    },
}
DEPLOYMENT = (kmock.resource("apps/v1/deployments"), "ns1", "tiny-long-workers")
POOL_KEY = (kmock.resource("flotilla.dev/v1alpha1/flotillapools"), "ns1", "tiny-long")


async def test_a_long_context_pool_scales_on_its_own_signals(kube, router, workers):
    registry = kopf.OperatorRegistry()
    register_handlers(registry, OperatorConfig(router_address=router.address, interval_s=0.2,
                                               kube_host=str(kube.url).rstrip("/"), tls_dir=OPERATOR_TLS,
                                               worker_tls_secret="flotilla-tls-worker"))
    operator = start_operator(registry)
    try:
        # The default pool of the same model and role, busy: 5000 queued tokens would be 4 long-pool replicas.
        workers.add("short-0", 5000, role=pb.WORKER_ROLE_BOTH)
        workers.add("short-1", 0, role=pb.WORKER_ROLE_BOTH)
        await kube.post("/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools", json=POOL)
        await async_wait_until(lambda: _get(kube, DEPLOYMENT, "spec", "replicas") == 1, 20, "the Deployment at min")
        args = kube.objects[DEPLOYMENT].raw["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--pool") + 1] == "long-context"

        workers.add("long-0", 0, role=pb.WORKER_ROLE_BOTH, pool="long-context")
        await async_wait_until(lambda: _get(kube, POOL_KEY, "status", "signals", "registeredActive") == 1, 20,
                               "the pool's own worker counted")
        await asyncio.sleep(1.0)  # several ticks on the pool's signals
        status = kube.objects[POOL_KEY].raw["status"]
        assert status["signals"]["queuedTokens"] == 0 and status["desiredReplicas"] == 1
        assert _get(kube, DEPLOYMENT, "spec", "replicas") == 1
        # A surplus of two active workers "of the pool" would have been drained: the default pool's are not its.
        assert set(workers.states().values()) == {rpb.WORKER_STATE_ACTIVE}

        workers.set_load("long-0", 3500)  # 3500 / 1000 per replica -> 4
        await async_wait_until(lambda: _get(kube, DEPLOYMENT, "spec", "replicas") == 4, 20, "scale-up to 4")
        await async_wait_until(lambda: _get(kube, POOL_KEY, "status", "signals", "queuedTokens") == 3500, 20,
                               "the pool's queued tokens in its status")
        assert set(workers.states().values()) == {rpb.WORKER_STATE_ACTIVE}
    finally:
        await operator.stop(20)
