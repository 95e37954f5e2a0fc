"""Every pod the release runs (each case's chart workloads and the operator's worker Deployments), hardened:
non-root, a read-only root filesystem with emptyDirs for the paths it writes, no capabilities, no privilege
escalation, the runtime's default seccomp profile, no service-account token except the operator's, and
liveness and readiness probes on every long-running container."""

from __future__ import annotations

import pytest

from flotilla.operator.pool_spec import KIND
from tests.chart.rendering import CASES, needs_helm, rendered_case, workloads

pytestmark = needs_helm
FLOTILLA_WRITABLE = {"/tmp", "/var/cache/flotilla"}  # Dockerfile: TMPDIR and the cache ENV


def pods(case: str) -> list[tuple[str, dict]]:
    """(kind/name, pod spec); a StatefulSet's claim templates count among its pod's volumes."""
    result = []
    for workload in workloads(rendered_case(case)):
        pod = dict(workload["spec"]["template"]["spec"])
        claims = [{"name": c["metadata"]["name"], "persistentVolumeClaim": {}}
                  for c in workload["spec"].get("volumeClaimTemplates", [])]
        pod["volumes"] = [*pod.get("volumes", []), *claims]
        result.append((f"{workload['kind']}/{workload['metadata']['name']}", pod))
    return result


@pytest.fixture(params=sorted(CASES))
def case(request) -> str:
    return request.param


def test_every_case_renders_the_expected_pods(case):
    names = {name for name, _ in pods(case)}
    for workload in ("Deployment/flotilla-gateway", "StatefulSet/flotilla-router", "Deployment/flotilla-operator"):
        assert workload in names, names
    # one decode pool per served model (pools are named <release>-<model slug>-<role>)
    workers = {n for n in names if n.endswith("-decode-workers")}
    pools = [doc for doc in rendered_case(case) if doc["kind"] == KIND]
    shared = [doc for doc in pools if doc["metadata"]["labels"]["app.kubernetes.io/component"] == "shared"]
    assert len(workers) == len({doc["spec"]["model"]["name"] for doc in pools if doc not in shared})
    assert len(workers) >= 1, names
    # the shared pool (values sharedPool) runs its own workers
    assert ("Deployment/flotilla-shared-pool-workers" in names) == bool(shared), names


def test_pods_run_as_non_root_with_the_default_seccomp_profile(case):
    for name, pod in pods(case):
        context = pod.get("securityContext", {})
        assert context.get("runAsNonRoot") is True, name
        assert isinstance(context.get("runAsUser"), int) and context["runAsUser"] > 0, name
        assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, name


def test_containers_drop_everything_on_a_read_only_root(case):
    for name, pod in pods(case):
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = container.get("securityContext", {})
            where = f"{name} container {container['name']}"
            assert context.get("readOnlyRootFilesystem") is True, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("capabilities") == {"drop": ["ALL"]}, where
            assert not context.get("privileged"), where


def test_writable_paths_are_empty_dirs_or_volumes(case):
    for name, pod in pods(case):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
            for mount in mounts.values():
                assert mount["name"] in volumes, f"{name}: mount of undeclared volume {mount['name']}"
            if container["image"].startswith("ghcr.io/flotilla/"):
                missing = FLOTILLA_WRITABLE - set(mounts)
                assert not missing, f"{name}: {missing} not mounted on a read-only root"
                for path in FLOTILLA_WRITABLE:
                    assert "emptyDir" in volumes[mounts[path]["name"]], f"{name}: {path} is not an emptyDir"


def test_only_the_operator_gets_a_service_account_token(case):
    for name, pod in pods(case):
        if name.endswith("-operator"):
            assert pod.get("automountServiceAccountToken") is True and pod.get("serviceAccountName"), name
        else:
            assert pod.get("automountServiceAccountToken") is False, name


def test_every_container_has_liveness_and_readiness_probes(case):
    for name, pod in pods(case):
        for container in pod["containers"]:
            for probe in ("livenessProbe", "readinessProbe"):
                assert probe in container, f"{name} container {container['name']} has no {probe}"


def test_workers_are_ready_only_when_their_health_says_so(case):
    for name, pod in pods(case):
        if name.endswith("-workers"):
            (worker,) = pod["containers"]
            command = worker["readinessProbe"]["exec"]["command"]
            assert command[:3] == ["flotilla", "probe", "worker"], command
            port = worker["ports"][0]["containerPort"]
            assert command[3] == f"127.0.0.1:{port}"
            assert worker["startupProbe"]["tcpSocket"] == {"port": "grpc"}  # weights load before the port opens
