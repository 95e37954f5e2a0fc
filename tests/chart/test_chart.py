"""The Helm chart rendered by a real helm binary (`make helm`), for the default values and every example
values file: equal to its golden file, valid against the Kubernetes 1.35 schemas (kubernetes-validate,
strict), FlotillaPools valid against the chart's own CRD schema, and the Deployments and Services the
operator builds from those pools valid too."""

from __future__ import annotations

import copy
import os

import jsonschema
import kubernetes_validate
import pytest
import yaml

from flotilla.operator.manifests import deployment, service
from flotilla.operator.pool_spec import parse_spec
from tests.chart.rendering import CASES, CHART, documents, needs_helm, operator_env, render

KUBERNETES_VERSION = "1.35.0"
# Kinds whose schemas kubernetes-validate does not ship: the chart's own CRD (checked below against the CRD's
# schema), the Gateway API HTTPRoute (tests/chart/test_ingress.py) and the Prometheus operator's ServiceMonitor
# and PodMonitor (not checked: their CRDs are not vendored here).
CUSTOM_KINDS = {"FlotillaPool", "ServiceMonitor", "PodMonitor", "HTTPRoute"}

pytestmark = needs_helm
# The lease Secret is random where helm sees no cluster (`helm template`): a fixed one keeps the goldens stable.
GOLDEN_LEASE_SECRET = ("--set", "leases.secret=golden-lease-secret-not-for-use")


@pytest.fixture(scope="module", params=sorted(CASES))
def rendered(request) -> tuple[str, str]:
    result = render(CASES[request.param], *GOLDEN_LEASE_SECRET)
    if result.returncode != 0:
        raise AssertionError(f"helm template failed for {request.param}:\n{result.stderr}")
    return request.param, result.stdout


def crd_schema() -> dict:
    crd = yaml.safe_load((CHART / "crds" / "flotillapools.yaml").read_text())
    return _json_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def _json_schema(node):
    """OpenAPI v3.0 (as in CRDs) to JSON Schema draft 4: `nullable` becomes a null type; x-kubernetes-*
    extensions (CEL rules, int-or-string markers) are dropped: the API server's admission is not emulated."""
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def test_rendered_matches_golden_file(rendered):
    name, text = rendered
    golden = CHART / "golden" / f"{name}.yaml"
    if os.environ.get("FLOTILLA_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}: run with FLOTILLA_UPDATE_GOLDEN=1 and review the diff"
    assert text == golden.read_text(), f"{name} renders differently from {golden}; update it if intended"


def test_rendered_is_valid_kubernetes_strict(rendered):
    name, text = rendered
    kinds = set()
    for doc in documents(text):
        kinds.add(doc["kind"])
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert {"CustomResourceDefinition", "Deployment", "Service", "Role", "FlotillaPool"} <= kinds


def test_pools_are_valid_custom_resources_and_build_valid_workloads(rendered):
    name, text = rendered
    validator = jsonschema.Draft4Validator(crd_schema())
    pools = [doc for doc in documents(text) if doc["kind"] == "FlotillaPool"]
    assert pools
    for pool in pools:
        validator.validate(pool)
        spec = parse_spec(pool["spec"])
        body = {"metadata": {**pool["metadata"], "namespace": "flotilla", "uid": "0000"}}
        for manifest in (deployment(body, spec, 3, pool["spec"]["routerAddress"]), service(body, spec)):
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_crd_schema_rejects_a_bad_pool():
    pool = documents(render(None).stdout)
    (good,) = [doc for doc in pool if doc["kind"] == "FlotillaPool"]
    validator = jsonschema.Draft4Validator(crd_schema())
    for path, value in [(("role",), "sideways"), (("replicas", "max"), 0), (("worker", "image"), "")]:
        bad = copy.deepcopy(good)
        target = bad["spec"]
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)


@pytest.mark.parametrize("flag", ["gateway.image.tag=latest", "decode.autoscaling.kvUtilisation=1.5",
                                  "prefill.replicas=-1", "decode.unknownKey=1"])
def test_values_schema_rejects_bad_values(flag):
    result = render(None, "--set", flag)
    assert result.returncode != 0 and "schema" in result.stderr, result.stderr


def test_prefill_and_decode_blocks_have_the_same_shape():
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def shape(node):
        return {k: shape(v) for k, v in node.items()} if isinstance(node, dict) else type(node).__name__

    assert shape(values["prefill"]) == shape(values["decode"])
    common = {"enabled", "replicas", "image", "resources", "autoscaling", "monitoring", "podDisruptionBudget",
              "extraEnv", "extraArgs"}
    for role in ("gateway", "router", "prefill", "decode", "operator"):
        assert common <= set(values[role]), role


def test_lease_secret_is_random_per_install_and_mounted_by_the_router():
    """Without leases.secret (and no cluster to read one back from) each install gets its own random secret;
    the router mounts it and signs with it, and the operator names it to its worker pods."""
    secrets = []
    for _ in range(2):
        docs = documents(render(None).stdout)
        (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "flotilla-lease-secret"]
        secrets.append(secret["stringData"]["secret"])
    assert len(secrets[0]) == 64 and secrets[0] != secrets[1]
    (router,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "flotilla-router"]
    pod = router["spec"]["template"]["spec"]
    assert "--lease-secret-file=/etc/flotilla/leases/secret" in pod["containers"][0]["args"]
    assert {"name": "leases", "mountPath": "/etc/flotilla/leases", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert {"name": "leases", "secret": {"secretName": "flotilla-lease-secret", "defaultMode": 0o440}} in pod["volumes"]
    assert operator_env(docs)["FLOTILLA_WORKER_LEASE_SECRET"] == "flotilla-lease-secret"


def test_lease_secret_existing_or_off():
    docs = documents(render(None, "--set", "leases.existingSecret=mine").stdout)
    assert not [d for d in docs if d["kind"] == "Secret" and "lease" in d["metadata"]["name"]]
    assert operator_env(docs)["FLOTILLA_WORKER_LEASE_SECRET"] == "mine"
    docs = documents(render(None, "--set", "leases.enabled=false").stdout)
    assert not [d for d in docs if d["kind"] == "Secret" and "lease" in d["metadata"]["name"]]
    assert "FLOTILLA_WORKER_LEASE_SECRET" not in operator_env(docs)
    (router,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "flotilla-router"]
    assert not [a for a in router["spec"]["template"]["spec"]["containers"][0]["args"] if "lease" in a]
