"""The real kopf operator against the kmock emulator and a real router: an FlotillaPool creates its
Deployment and Service (owner references set), a change of signals scales it, status is written."""

from __future__ import annotations

import kmock
import kopf

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers

from tests.support.tls import identity_dir
from tests.support.waiting import async_wait_until
from .kopf_run import start_operator

OPERATOR_TLS = str(identity_dir("operator", "operator"))  # the router lets operators steer workers

POOL = {
    "apiVersion": "flotilla.dev/v1alpha1",
    "kind": "FlotillaPool",
    # kmock keeps no resourceVersion of its own: one set here stays constant, so kopf's patches that test it
    # pass (and the handlers must be idempotent: nothing detects a concurrent write).
    "metadata": {"name": "decode-a", "namespace": "ns1", "uid": "uid-decode-a", "resourceVersion": "1"},
    "spec": {
        "model": {"name": "tiny", "version": "v1", "checkpoint": "/models/tiny"},
        "role": "decode",
        "replicas": {"min": 1, "max": 6, "warm": 1},
        "targets": {"queuedTokensPerReplica": 1000, "kvUtilisation": 0.8, "ttftP95Seconds": 30},
        "scaling": {"scaleUpCooldownSeconds": 0, "scaleDownCooldownSeconds": 600, "signalsWindowSeconds": 30},
        "worker": {"image": "ghcr.io/flotilla/worker:0.1.0", "resources": {"limits": {"nvidia.com/gpu": 1}}},
    },
}
# Keys with parsed resources: `key in kmock.objects` does not parse a "group/version/plural" string.
DEPLOYMENT = (kmock.resource("apps/v1/deployments"), "ns1", "decode-a-workers")
SERVICE = (kmock.resource("v1/services"), "ns1", "decode-a-workers")
POOL_KEY = (kmock.resource("flotilla.dev/v1alpha1/flotillapools"), "ns1", "decode-a")


def _get(kube: kmock.KubernetesEmulator, key, *path):
    if key not in kube.objects or kube.objects[key].deleted:
        return None
    value = kube.objects[key].raw
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


async def test_pool_creates_deployment_scales_on_signals_and_writes_status(kube, router, workers):
    registry = kopf.OperatorRegistry()
    metrics = register_handlers(registry, OperatorConfig(router_address=router.address, interval_s=0.2,
                                               kube_host=str(kube.url).rstrip("/"),
                                               tls_dir=OPERATOR_TLS, worker_tls_secret="flotilla-tls-worker"))
    operator = start_operator(registry)
    try:
        await kube.post(f"/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools", json=POOL)
        await async_wait_until(lambda: _get(kube, DEPLOYMENT, "spec", "replicas") == 2, 20,
                               "the Deployment at min + warm")
        deployment = kube.objects[DEPLOYMENT].raw
        owner = deployment["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == \
            ("FlotillaPool", "decode-a", "uid-decode-a", True)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
        assert "--router" in container["args"] and router.address in container["args"]
        await async_wait_until(lambda: _get(kube, SERVICE, "spec", "clusterIP") == "None", 20,
                               "the headless Service")

        # Its two pods register (in rotation, as new pods do): the operator demotes one to the warm pool.
        workers.add("decode-a-0")
        workers.add("decode-a-1")
        one_of_each = [rpb.WORKER_STATE_ACTIVE, rpb.WORKER_STATE_WARM]
        await async_wait_until(lambda: sorted(workers.states().values()) == one_of_each, 20, "one active, one warm")
        await async_wait_until(lambda: _get(kube, POOL_KEY, "status", "warmReplicas") == 1, 20, "status written")

        # Signals change: 3500 queued tokens at 1000 per replica -> 4 active: the warm one is promoted,
        # two more pods and the warm refill are added to the Deployment.
        active = [w for w, s in workers.states().items() if s == rpb.WORKER_STATE_ACTIVE][0]
        workers.set_load(active, 3500)
        await async_wait_until(lambda: _get(kube, DEPLOYMENT, "spec", "replicas") == 5, 20,
                               "scale-up to 4 active + 1 warm")
        assert set(workers.states().values()) == {rpb.WORKER_STATE_ACTIVE}
        await async_wait_until(lambda: _get(kube, POOL_KEY, "status", "signals", "queuedTokens") == 3500, 20,
                               "signals")
        status = kube.objects[POOL_KEY].raw["status"]
        assert (status["desiredReplicas"], status["activeReplicas"], status["warmReplicas"]) == (5, 4, 1)
        assert status["lastDecision"]["reason"]  # "up 1->4 (queued tokens 3500): ..." then "hold"
        assert status["lastScaleUpTime"] is not None
        labels = {"pool": "decode-a", "model": "tiny", "role": "decode"}
        desired = [s.value for s in metrics.desired_replicas.collect()[0].samples if s.labels == labels]
        assert desired == [5]  # the gauge follows the status
    finally:
        await operator.stop(20)
