"""The few Kubernetes calls the operator makes, idempotent: create-or-patch (no resourceVersion needed)."""

from __future__ import annotations

from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException


def api_client(host: str | None) -> kubernetes.client.ApiClient:
    """host: an API server URL without credentials (tests, kubectl proxy); None: in-cluster, else kubeconfig."""
    if host:
        configuration = kubernetes.client.Configuration()
        configuration.host = host
        return kubernetes.client.ApiClient(configuration)
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient):
        self.apps = kubernetes.client.AppsV1Api(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves this resource (its CRD is installed), from API discovery."""
        try:
            resources = self.custom.get_api_resources(group, version)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return any(r.name == plural for r in resources.resources or [])

    def apply_custom(self, group: str, version: str, plural: str, manifest: dict[str, Any]) -> None:
        """Create, or merge-patch the existing one."""
        meta = manifest["metadata"]
        try:
            self.custom.get_namespaced_custom_object(group, version, meta["namespace"], plural, meta["name"])
        except ApiException as error:
            if error.status != 404:
                raise
            self.custom.create_namespaced_custom_object(group, version, meta["namespace"], plural, manifest)
            return
        self.custom.patch_namespaced_custom_object(group, version, meta["namespace"], plural, meta["name"], manifest)

    def apply_deployment(self, manifest: dict[str, Any], keep_replicas: bool) -> dict[str, Any]:
        """Create, or patch the existing one. keep_replicas: leave its replicas alone (the timer owns them)."""
        meta = manifest["metadata"]
        existing = self.read_deployment(meta["namespace"], meta["name"])
        if existing is None:
            return self.apps.create_namespaced_deployment(meta["namespace"], manifest).to_dict()
        patch = {**manifest, "spec": dict(manifest["spec"])}
        if keep_replicas:
            patch["spec"].pop("replicas")
        return self.apps.patch_namespaced_deployment(meta["name"], meta["namespace"], patch).to_dict()

    def apply_service(self, manifest: dict[str, Any]) -> None:
        meta = manifest["metadata"]
        try:
            self.core.read_namespaced_service(meta["name"], meta["namespace"])
        except ApiException as error:
            if error.status != 404:
                raise
            self.core.create_namespaced_service(meta["namespace"], manifest)
            return
        self.core.patch_namespaced_service(meta["name"], meta["namespace"], manifest)

    def read_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.apps.read_namespaced_deployment(name, namespace).to_dict()
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment(name, namespace, {"spec": {"replicas": replicas}})

    def annotate_pod(self, namespace: str, name: str, key: str, value: str | None) -> bool:
        """value None removes the annotation. False when the pod is gone already."""
        try:
            self.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {key: value}}})
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True
