"""Manifest builders, pure: an FlotillaPool to its worker Deployment and Service (dicts, no cluster)."""

from __future__ import annotations

from typing import Any

from flotilla.operator.pool_spec import GROUP, KIND, VERSION, PoolSpec

POOL_LABEL = "flotilla.dev/pool"
ROLE_LABEL = "flotilla.dev/role"
# The ReplicaSet deletes pods with the lowest cost first: a drained worker gets this before a scale-down.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
DRAINED_DELETION_COST = "-1000"
# The image's user (Dockerfile) and the only paths a worker writes on its read-only root filesystem: scratch, the
# caches (the CPU decode kernel, compiled on first use; Hugging Face; Triton) and shared memory (torch, UCX).
IMAGE_UID = 10001
WRITABLE_PATHS = {"tmp": "/tmp", "cache": "/var/cache/flotilla", "shm": "/dev/shm"}
TLS_DIR = "/etc/flotilla/tls"  # the workers' certificate Secret (ca.crt, tls.crt, tls.key), mounted read-only
LEASE_DIR = "/etc/flotilla/leases"  # the router's placement-lease secret (key `secret`), mounted read-only


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """The pool owns what it creates: deleting the pool garbage-collects them (in a real cluster)."""
    meta = body["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
        "controller": True, "blockOwnerDeletion": True,
    }


INSTANCE_LABEL = "app.kubernetes.io/instance"  # the Helm release: its NetworkPolicies select workers by it
METRICS_PORT = 9091


def labels(body: dict[str, Any], spec: PoolSpec) -> dict[str, str]:
    instance = (body["metadata"].get("labels") or {}).get(INSTANCE_LABEL)
    return {
        "app.kubernetes.io/name": "flotilla-worker", "app.kubernetes.io/managed-by": "flotilla-operator",
        POOL_LABEL: body["metadata"]["name"], ROLE_LABEL: spec.role, **({INSTANCE_LABEL: instance} if instance else {}),
    }


def worker_name(pool_name: str) -> str:
    return f"{pool_name}-workers"


def deployment(body: dict[str, Any], spec: PoolSpec, replicas: int, router_address: str,
               tls_secret: str = "", lease_secret: str = "") -> dict[str, Any]:
    """`tls_secret`: the Secret with the workers' mTLS certificate (a worker identity); "": the workers run
    with --insecure-internal. `lease_secret`: the Secret with the router's lease secret (key `secret`): the
    workers then serve only streams with a valid placement lease, which gateways open on them directly; "":
    no lease check (only the router streams from them)."""
    name = body["metadata"]["name"]
    selector = {POOL_LABEL: name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": worker_name(name), "namespace": body["metadata"]["namespace"],
            "labels": labels(body, spec), "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # The operator drains before it lowers replicas; a rollout must not kill streams either.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(body, spec)},
                "spec": {
                    "terminationGracePeriodSeconds": 120,
                    "automountServiceAccountToken": False,  # a worker never calls the Kubernetes API
                    "securityContext": pod_security_context(),
                    "containers": [_container(spec, router_address, tls_secret, lease_secret)],
                    "volumes": [*_writable_volumes(), *_tls_volumes(tls_secret), *_lease_volumes(lease_secret),
                                *spec.worker.volumes],
                },
            },
        },
    }


def _container(spec: PoolSpec, router_address: str, tls_secret: str, lease_secret: str) -> dict[str, Any]:
    port = spec.worker.port
    args = [
        "worker", "--host", "0.0.0.0", "--port", str(port), "--advertise-host", "$(POD_IP)",
        "--worker-id", "$(POD_NAME)", "--router", router_address,
        "--model-dir", spec.model.checkpoint, "--model-name", spec.model.name, "--role", spec.role,
        *(["--pool", spec.pool] if spec.pool else []), "--metrics-port", str(METRICS_PORT), *([] if tls_secret else ["--insecure-internal"]),
        *(["--lease-secret-file", f"{LEASE_DIR}/secret"] if lease_secret else []), *spec.worker.args,
    ]  # fmt: skip
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # The worker and its exec probe (`flotilla probe worker`) read the certificate from here.
        *([{"name": "FLOTILLA_TLS_DIR", "value": TLS_DIR}] if tls_secret else []),
        *spec.worker.env,
    ]
    container: dict[str, Any] = {
        "name": "worker", "image": spec.worker.image, "command": ["flotilla"], "args": args, "env": env,
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        **_probes(port),
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        "volumeMounts": [*({"name": name, "mountPath": path} for name, path in WRITABLE_PATHS.items()),
                         *([{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if tls_secret else []),
                         *([{"name": "leases", "mountPath": LEASE_DIR, "readOnly": True}] if lease_secret else []),
                         *spec.worker.volume_mounts],
    }
    if spec.worker.resources:
        container["resources"] = _quantities_as_strings(spec.worker.resources)
    return container


CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
}


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _writable_volumes() -> list[dict[str, Any]]:
    return [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}}]


def _tls_volumes(tls_secret: str) -> list[dict[str, Any]]:
    return [{"name": "tls", "secret": {"secretName": tls_secret, "defaultMode": 0o440}}] if tls_secret else []


def _lease_volumes(lease_secret: str) -> list[dict[str, Any]]:
    return [{"name": "leases", "secret": {"secretName": lease_secret, "defaultMode": 0o440}}] if lease_secret else []


def _probes(port: int) -> dict[str, Any]:
    """The worker opens its gRPC port once its weights are loaded: the startup probe (up to 30 minutes) and then
    liveness watch the port. Ready only when WorkerService.Health says so (engine running and, where the worker
    runs it, the golden-output check passing): `flotilla probe worker`. A failed check takes the pod out of
    Ready (and so holds a rollout) without restarting it; the router has taken the worker out of rotation."""
    port_open = {"tcpSocket": {"port": "grpc"}, "periodSeconds": 10}
    return {
        "startupProbe": {**port_open, "failureThreshold": 180},
        "readinessProbe": {"exec": {"command": ["flotilla", "probe", "worker", f"127.0.0.1:{port}"]},
                           "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**port_open, "failureThreshold": 3},
    }


def _quantities_as_strings(resources: dict[str, Any]) -> dict[str, Any]:
    """Quantities are int-or-string in the CRD (`nvidia.com/gpu: 1`); the Pod API wants strings."""
    return {kind: {name: str(value) for name, value in amounts.items()} for kind, amounts in resources.items()}


def service(body: dict[str, Any], spec: PoolSpec) -> dict[str, Any]:
    """Headless: the router dials each worker by the address it registers; the Service gives them DNS."""
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": worker_name(name), "namespace": body["metadata"]["namespace"],
            "labels": labels(body, spec), "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {POOL_LABEL: name},
            "ports": [{"name": "grpc", "port": spec.worker.port, "targetPort": "grpc", "protocol": "TCP"}],
        },
    }
