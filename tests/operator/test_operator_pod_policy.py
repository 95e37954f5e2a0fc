"""The real kopf operator against kmock with the chart's pod policy (only Flotilla's image repository, no
hostPath): a pool naming another image or a hostPath volume gets no Deployment and says why in status.refused;
the same pool made acceptable is reconciled and the refusal cleared."""

from __future__ import annotations

import copy

import kmock
import kopf

from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers
from flotilla.operator.pod_policy import PodPolicy

from tests.support.waiting import async_wait_until
from .kopf_run import start_operator

POLICY = PodPolicy(allowed_images=("ghcr.io/flotilla/flotilla",), allow_host_path=False)
POOL = {
    "apiVersion": "flotilla.dev/v1alpha1", "kind": "FlotillaPool",
    "metadata": {"name": "p", "namespace": "ns1", "uid": "uid-p", "resourceVersion": "1"},
    "spec": {"model": {"name": "tiny", "checkpoint": "/models/tiny"}, "role": "both",
             "replicas": {"min": 1, "max": 2, "warm": 0},
             "worker": {"image": "docker.io/library/busybox:1.36"}},
}
POOLS = "/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools"


def _key(resource: str, name: str):
    return kmock.resource(resource), "ns1", name


def _status(kube, name: str) -> dict:
    key = _key("flotilla.dev/v1alpha1/flotillapools", name)
    return (kube.objects[key].raw.get("status") or {}) if key in kube.objects else {}


async def test_other_images_and_host_paths_are_refused_until_allowed(kube):
    registry = kopf.OperatorRegistry()
    register_handlers(registry, OperatorConfig(kube_host=str(kube.url).rstrip("/"), interval_s=0.2,
                                               pod_policy=POLICY, insecure_internal=True))
    operator = start_operator(registry)
    host_path = copy.deepcopy(POOL)
    host_path["metadata"].update(name="h", uid="uid-h")
    host_path["spec"]["worker"] = {"image": "ghcr.io/flotilla/flotilla:0.1.0",
                                   "volumes": [{"name": "model", "hostPath": {"path": "/srv/models"}}],
                                   "volumeMounts": [{"name": "model", "mountPath": "/models"}]}
    try:
        await kube.post(POOLS, json=POOL)
        await kube.post(POOLS, json=host_path)
        await async_wait_until(lambda: "busybox" in (_status(kube, "p").get("refused") or ""), 20, "p refused")
        await async_wait_until(lambda: "hostPath" in (_status(kube, "h").get("refused") or ""), 20, "h refused")
        assert not [key for key in kube.objects if key[0].plural in ("deployments", "services")]

        # The same pool with Flotilla's image (another tag) is reconciled, and its refusal cleared.
        await kube.patch(f"{POOLS}/p", json={"spec": {"worker": {"image": "ghcr.io/flotilla/flotilla:0.2.0"}}})
        deployment = _key("apps/v1/deployments", "p-workers")
        await async_wait_until(lambda: deployment in kube.objects, 20, "p's Deployment once allowed")
        await async_wait_until(lambda: not _status(kube, "p").get("refused"), 20, "the refusal cleared")
        assert _key("apps/v1/deployments", "h-workers") not in kube.objects
    finally:
        await operator.stop(10)
