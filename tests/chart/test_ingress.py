"""HTTP(S) into the gateway: the Ingress (on by default) and the Gateway API HTTPRoute (the disaggregated
example) route to the gateway Service's HTTP port with streaming-friendly settings, TLS from a Secret; the
HTTPRoute is validated against a schema of Gateway API v1 written in tests/chart/gateway_api.py (and against
the real CRD when FLOTILLA_GATEWAY_API_CRD names it). test_chart_processes.py sends the SDKs' requests to the
Service and port these objects name."""

from __future__ import annotations

import os
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.chart.gateway_api import HTTPROUTE, cel_rules
from tests.chart.rendering import needs_helm, render, rendered_case
from tests.chart.test_chart import KUBERNETES_VERSION, _json_schema

pytestmark = needs_helm
ROUTE = ("--set", "httpRoute.enabled=true", "--set", "httpRoute.parentRefs[0].name=public")


def one(docs, kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def service_port(docs, name: str, port: int | str) -> dict:
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name]
    return next(p for p in service["spec"]["ports"] if port in (p["port"], p.get("name")))


def test_default_ingress_streams_to_the_gateway_service():
    docs = rendered_case("default")
    ingress = one(docs, "Ingress")
    (rule,) = ingress["spec"]["rules"]
    assert "host" not in rule and "tls" not in ingress["spec"]  # every host, plain HTTP until a Secret is named
    (path,) = rule["http"]["paths"]
    backend = path["backend"]["service"]
    assert service_port(docs, backend["name"], backend["port"]["name"])["port"] == 8080
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600
    assert int(notes["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 3600
    assert notes["nginx.ingress.kubernetes.io/proxy-body-size"] == "4194304"  # = the gateway's --max-body-bytes
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway"))
    assert "--max-body-bytes=4194304" in gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [d for d in docs if d["kind"] == "HTTPRoute"]


def test_ingress_tls_from_a_secret_for_its_hosts():
    ingress = one(rendered_case("single-node-cpu"), "Ingress")
    assert ingress["spec"]["tls"] == [{"secretName": "flotilla-tls", "hosts": ["flotilla.internal.example"]}]
    assert [r["host"] for r in ingress["spec"]["rules"]] == ["flotilla.internal.example"]
    kubernetes_validate.validate(ingress, KUBERNETES_VERSION, strict=True)
    body = one(rendered_case("default", "--set", "keys.limits.maxBodyBytes=1000", "--set",
                             "ingress.annotations.nginx\\.ingress\\.kubernetes\\.io/proxy-body-size=2k"), "Ingress")
    assert body["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"] == "2k"  # set wins
    assert not [d for d in rendered_case("default", "--set", "ingress.enabled=false") if d["kind"] == "Ingress"]


@pytest.mark.parametrize("case,extra", [("disaggregated-gpu", ()), ("default", ROUTE)])
def test_httproute_is_valid_gateway_api_and_targets_the_gateway_service(case, extra):
    docs = rendered_case(case, *extra)
    route = one(docs, "HTTPRoute")
    jsonschema.Draft7Validator(HTTPROUTE).validate(route)
    assert cel_rules(route) == []
    # ObjectMeta as the API server checks it, through a kind kubernetes-validate knows
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": route["metadata"]},
                                 KUBERNETES_VERSION, strict=True)
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert service_port(docs, backend["name"], backend["port"])["name"] == "http"
    assert rule["timeouts"] == {"request": "1h", "backendRequest": "1h"}  # streams outlive 15 s defaults


def test_httproute_against_the_real_crd_when_given():
    crd_path = os.environ.get("FLOTILLA_GATEWAY_API_CRD")
    if not crd_path:
        pytest.skip("FLOTILLA_GATEWAY_API_CRD not set (Gateway API's HTTPRoute CRD is not vendored)")
    crd = yaml.safe_load(Path(crd_path).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    route = one(rendered_case("disaggregated-gpu"), "HTTPRoute")
    jsonschema.Draft4Validator(_json_schema(version["schema"]["openAPIV3Schema"])).validate(route)


def test_httproute_needs_a_parent_and_valid_values():
    result = render(None, "--set", "httpRoute.enabled=true")
    assert result.returncode != 0 and "httpRoute.parentRefs" in result.stderr
    for bad in (("--set", "httpRoute.timeouts.request=forever"), ("--set", "httpRoute.hostnames[0]=Bad_Host"),
                ("--set", "httpRoute.path=api"), ("--set", "ingress.hosts[0]=-x.example")):
        result = render(None, *ROUTE, *bad)
        assert result.returncode != 0 and "schema" in result.stderr, bad


def test_schema_and_cel_stand_ins_refuse_what_the_crd_refuses():
    route = one(rendered_case("disaggregated-gpu"), "HTTPRoute")
    for mutate in (lambda r: r["spec"]["rules"][0]["timeouts"].update(request="1 hour"),
                   lambda r: r["spec"]["parentRefs"][0].update(namespace="Gateway_System"),
                   lambda r: r["spec"]["rules"][0].update(filters=[]),  # a field this schema does not know
                   lambda r: r["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix")):
        broken = yaml.safe_load(yaml.safe_dump(route))
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft7Validator(HTTPROUTE).validate(broken)
    broken = yaml.safe_load(yaml.safe_dump(route))
    broken["spec"]["rules"][0]["timeouts"] = {"request": "10s", "backendRequest": "1m"}
    broken["spec"]["rules"][0]["backendRefs"][0].pop("port")
    assert len(cel_rules(broken)) == 2
