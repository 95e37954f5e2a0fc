"""Manifest builders and spec parsing, pure: no cluster."""

from __future__ import annotations

import pytest

from flotilla.operator.manifests import deployment, service
from flotilla.operator.pool_spec import InvalidPoolSpec, parse_spec

BODY = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"}}
SPEC = {
    "model": {"name": "m", "version": "v1", "checkpoint": "/models/m"},
    "role": "prefill",
    "replicas": {"min": 2, "max": 8, "warm": 1},
    "worker": {"image": "img:1.0", "args": ["--block-size", 32], "resources": {"limits": {"cpu": 2}}},
}


def test_spec_parses_into_the_control_law_policy():
    pool = parse_spec(SPEC)
    assert (pool.policy.min_replicas, pool.policy.max_replicas, pool.policy.warm_replicas) == (2, 8, 1)
    assert pool.worker.args == ("--block-size", "32") and pool.role == "prefill"


@pytest.mark.parametrize("bad", [
    {**SPEC, "role": "both-ish"}, {**SPEC, "replicas": {"min": 3, "max": 2}}, {k: v for k, v in SPEC.items() if k != "model"},
])
def test_bad_spec_raises(bad):
    with pytest.raises(InvalidPoolSpec):
        parse_spec(bad)


def test_deployment_and_service_are_owned_labelled_and_selected_alike():
    pool = parse_spec(SPEC)
    dep = deployment(BODY, pool, 3, "router:50050")
    svc = service(BODY, pool)
    assert dep["spec"]["replicas"] == 3
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "u1" == svc["metadata"]["ownerReferences"][0]["uid"]
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"cpu": "2"}}
    assert container["args"][-2:] == ["--block-size", "32"] and "$(POD_NAME)" in container["args"]
    assert container["args"][container["args"].index("--role") + 1] == "prefill"  # the pool's role, not "both"


def test_workers_carry_the_pools_release_label_and_serve_metrics():
    pool = parse_spec(SPEC)
    body = {"metadata": {**BODY["metadata"], "labels": {"app.kubernetes.io/instance": "rel"}}}
    dep = deployment(body, pool, 1, "router:50050")
    assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    assert "app.kubernetes.io/instance" not in dep["spec"]["selector"]["matchLabels"]  # selectors are immutable
    assert "app.kubernetes.io/instance" not in deployment(BODY, pool, 1, "r:1")["spec"]["template"]["metadata"]["labels"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--metrics-port") + 1] == "9091"
    assert {"name": "metrics", "containerPort": 9091, "protocol": "TCP"} in container["ports"]


def test_a_pool_with_its_own_worker_certificate_mounts_it():
    from flotilla.operator.config import OperatorConfig

    own = parse_spec({**SPEC, "worker": {**SPEC["worker"], "tlsSecret": "decode-a-tls"}})
    shared = parse_spec(SPEC)
    config = OperatorConfig(tls_dir="/etc/flotilla/tls", worker_tls_secret="flotilla-tls-worker")
    assert config.worker_tls_secret_of(own) == "decode-a-tls"
    assert config.worker_tls_secret_of(shared) == "flotilla-tls-worker"
    assert OperatorConfig(insecure_internal=True).worker_tls_secret_of(own) == ""  # plaintext fleet: ignored
    body = {"metadata": {"name": "decode-a", "namespace": "ns1", "uid": "u1"}}
    built = deployment(body, own, 1, "router:50050", config.worker_tls_secret_of(own))
    volumes = built["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "decode-a-tls", "defaultMode": 0o440}} in volumes


def test_a_lease_secret_is_mounted_and_named_to_the_worker(monkeypatch):
    from flotilla.operator.config import OperatorConfig

    monkeypatch.setenv("FLOTILLA_WORKER_LEASE_SECRET", "rel-lease-secret")
    lease_secret = OperatorConfig.from_env().worker_lease_secret
    assert lease_secret == "rel-lease-secret"
    pod = deployment(BODY, parse_spec(SPEC), 1, "router:50050", "", lease_secret)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "leases", "secret": {"secretName": "rel-lease-secret", "defaultMode": 0o440}} in pod["volumes"]
    assert {"name": "leases", "mountPath": "/etc/flotilla/leases", "readOnly": True} in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--lease-secret-file") + 1] == "/etc/flotilla/leases/secret"
    # without one: no lease check, nothing mounted
    plain = deployment(BODY, parse_spec(SPEC), 1, "router:50050")["spec"]["template"]["spec"]
    assert "--lease-secret-file" not in plain["containers"][0]["args"]
    assert not [v for v in plain["volumes"] if v["name"] == "leases"]
