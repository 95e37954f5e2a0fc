"""The operator's reach: a namespaced Role unless it watches several namespaces (or a glob); kopf watches exactly
those namespaces; the pod policy the chart passes (read by the operator's own config loader) admits the
rendered pools and refuses other images and hostPath volumes unless values allow them."""

from __future__ import annotations

import pytest

from flotilla.operator.config import OperatorConfig
from flotilla.operator.pool_spec import KIND, parse_spec
from tests.chart.rendering import CASES, NAMESPACE, needs_helm, render, rendered_case

pytestmark = needs_helm
RBAC_KINDS = {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
CLUSTER_SCOPED = {"namespaces", "customresourcedefinitions", "nodes", "persistentvolumes"}


def rbac(docs) -> dict[str, dict]:
    return {d["kind"]: d for d in docs if d["kind"] in RBAC_KINDS}


def operator_container(docs) -> dict:
    (found,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")]
    return found["spec"]["template"]["spec"]["containers"][0]


def watched(docs) -> list[str]:
    return [a.removeprefix("--namespace=") for a in operator_container(docs)["args"] if a.startswith("--namespace=")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_namespaced_by_default(case):
    docs = rendered_case(case)
    objects = rbac(docs)
    assert set(objects) == {"Role", "RoleBinding"}
    role, binding = objects["Role"], objects["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert not {r for rule in role["rules"] for r in rule["resources"]} & CLUSTER_SCOPED
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    assert watched(docs) == [NAMESPACE]


def test_one_other_namespace_is_still_a_role_there():
    docs = rendered_case("default", "--set", "operator.watchNamespaces={team-a}")
    assert {k: o["metadata"]["namespace"] for k, o in rbac(docs).items()} == {"Role": "team-a", "RoleBinding": "team-a"}
    assert watched(docs) == ["team-a"]
    env = {e["name"]: e.get("value") for e in operator_container(docs)["env"]}
    assert env["FLOTILLA_ROUTER_ADDRESS"] == f"flotilla-router.{NAMESPACE}.svc:50050"  # resolvable from team-a


@pytest.mark.parametrize("namespaces", ["{team-a,team-b}", "{team-*}"])
def test_several_namespaces_or_a_glob_are_cluster_wide(namespaces):
    docs = rendered_case("default", "--set", f"operator.watchNamespaces={namespaces}")
    objects = rbac(docs)
    assert set(objects) == {"ClusterRole", "ClusterRoleBinding"}
    resources = {r for rule in objects["ClusterRole"]["rules"] for r in rule["resources"]}
    assert {"namespaces", "customresourcedefinitions"} <= resources  # kopf's scans
    assert objects["ClusterRoleBinding"]["roleRef"]["kind"] == "ClusterRole"
    assert watched(docs) == namespaces.strip("{}").split(",")


def _policy(docs, monkeypatch):
    for var in operator_container(docs)["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    return OperatorConfig.from_env().pod_policy


@pytest.mark.parametrize("case", sorted(CASES))
def test_pod_policy_admits_the_rendered_pools_and_refuses_other_images(case, monkeypatch):
    docs = rendered_case(case)
    policy = _policy(docs, monkeypatch)
    pools = [parse_spec(d["spec"]) for d in docs if d["kind"] == KIND]
    assert pools and all(policy.violations(pool) == [] for pool in pools)
    other = parse_spec({**next(d for d in docs if d["kind"] == KIND)["spec"],
                        "worker": {"image": "docker.io/library/busybox:1.36"}})
    assert policy.violations(other)
    assert policy.allow_host_path == (case == "single-node-cpu")  # the example whose model is a node directory


def test_extra_images_and_host_path_only_from_values(monkeypatch):
    docs = rendered_case("default", "--set", "operator.podPolicy.extraImages={registry.internal:5000/ml/flotilla}")
    policy = _policy(docs, monkeypatch)
    assert policy.allowed_images == ("ghcr.io/flotilla/flotilla", "registry.internal:5000/ml/flotilla")
    result = render(None, "--set-json", 'models=[{"name": "m", "checkpoint": "/srv/models/m", "volume": {"hostPath": {"path": "/srv/models"}}}]')
    assert result.returncode != 0 and "operator.podPolicy.allowHostPath" in result.stderr
    result = render(None, "--set", "operator.podPolicy.extraImages={ghcr.io/x/y:1.0}")
    assert result.returncode != 0 and "schema" in result.stderr  # a repository, not an image with its tag
