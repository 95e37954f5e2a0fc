"""internalTLS as chart values: every gateway, router, operator and (as the operator builds them) worker
container gets its role's certificate Secret and FLOTILLA_TLS_DIR, or, with internalTLS.enabled false,
--insecure-internal and nothing mounted; cert-manager Certificates carry the identity the router checks.
test_chart_processes.py runs the rendered pods with `flotilla certs` output as values (the chart's Secrets)."""

from __future__ import annotations

from flotilla.operator.config import OperatorConfig

from tests.chart.rendering import needs_helm, operator_env, rendered_case, worker_deployments, workloads

pytestmark = needs_helm


def tls_wiring(docs) -> dict[str, tuple[str, str, bool]]:
    """container name -> (its tls Secret or "", FLOTILLA_TLS_DIR or "", --insecure-internal given)."""
    found = {}
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for container in pod["containers"]:
            if container["name"] == "redis":
                continue
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            found[container["name"]] = (secrets.get("tls", ""), env.get("FLOTILLA_TLS_DIR", ""),
                                        "--insecure-internal" in container.get("args", []))
    return found


def test_every_service_mounts_its_roles_certificate():
    wiring = tls_wiring(rendered_case("default"))
    assert wiring == {name: (f"flotilla-tls-{role}", "/etc/flotilla/tls", False) for name, role in
                      (("gateway", "gateway"), ("router", "router"), ("operator", "operator"), ("worker", "worker"))}
    named = rendered_case("default", "--set", "internalTLS.secrets.worker=issued-by-vault")
    assert tls_wiring(named)["worker"] == ("issued-by-vault", "/etc/flotilla/tls", False)


def test_disabled_means_insecure_internal_everywhere(monkeypatch):
    docs = rendered_case("default", "--set", "internalTLS.enabled=false")
    wiring = tls_wiring(docs)
    assert wiring["operator"] == ("", "", False)  # kopf's command; the operator reads the environment
    for name in ("gateway", "router", "worker"):
        assert wiring[name] == ("", "", True), name
    for name, value in operator_env(docs).items():
        monkeypatch.setenv(name, value)
    assert OperatorConfig.from_env().insecure_internal
    assert not any(doc["kind"] in ("Secret", "Certificate") and "-tls-" in doc["metadata"]["name"] for doc in docs)


def test_cert_manager_certificates_name_each_roles_identity():
    docs = rendered_case("default", "--set", "internalTLS.certManager.enabled=true",
                         "--set", "internalTLS.certManager.issuerRef.name=flotilla-ca")
    certificates = {doc["spec"]["secretName"]: doc["spec"] for doc in docs if doc["kind"] == "Certificate"}
    pools = [doc["metadata"]["name"] for doc in docs if doc["kind"] == "FlotillaPool"]
    assert set(certificates) == {f"flotilla-tls-{role}" for role in ("gateway", "router", "worker", "operator")} | {
        f"{pool}-tls" for pool in pools}
    worker = certificates["flotilla-tls-worker"]
    assert worker["uris"] == ["spiffe://flotilla/worker/flotilla-worker"]
    assert worker["dnsNames"] == ["worker.flotilla.internal"]
    assert worker["issuerRef"]["name"] == "flotilla-ca" and "client auth" in worker["usages"]


def test_cert_manager_gives_each_worker_pool_its_own_identity():
    docs = rendered_case("disaggregated-gpu", "--set", "internalTLS.certManager.enabled=true",
                         "--set", "internalTLS.certManager.issuerRef.name=flotilla-ca")
    certificates = {doc["spec"]["secretName"]: doc["spec"] for doc in docs if doc["kind"] == "Certificate"}
    pools = [doc for doc in docs if doc["kind"] == "FlotillaPool"]
    assert len(pools) >= 2  # a prefill and a decode pool: two identities
    for pool in pools:
        name = pool["metadata"]["name"]
        assert pool["spec"]["worker"]["tlsSecret"] == f"{name}-tls"
        assert certificates[f"{name}-tls"]["uris"] == [f"spiffe://flotilla/worker/{name}"]
        assert certificates[f"{name}-tls"]["dnsNames"] == ["worker.flotilla.internal"]  # what clients verify
    mounted = {d["metadata"]["name"]: v["secret"]["secretName"] for d in worker_deployments(docs)
               for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"}
    assert mounted == {f"{pool['metadata']['name']}-workers": f"{pool['metadata']['name']}-tls" for pool in pools}

    shared = rendered_case("disaggregated-gpu", "--set", "internalTLS.certManager.enabled=true",
                           "--set", "internalTLS.certManager.workerIdentity=release")
    assert not any("tlsSecret" in doc["spec"]["worker"] for doc in shared if doc["kind"] == "FlotillaPool")
    assert {v["secret"]["secretName"] for d in worker_deployments(shared)
            for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"} == {"flotilla-tls-worker"}
