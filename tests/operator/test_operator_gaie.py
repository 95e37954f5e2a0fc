"""The operator's Gateway API Inference Extension InferencePool: built per served model selecting the gateway
pods, valid against GAIE's own v1 CRD schema; applied by the real kopf operator (against kmock) from a decode
pool when the GAIE API is served, and not when it is not (mode auto)."""

from __future__ import annotations

import os
from pathlib import Path

import jsonschema
import kmock
import kopf
import pytest
import yaml

from flotilla.operator import gaie
from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers
from flotilla.operator.pool_spec import parse_spec
from tests.chart.test_chart import _json_schema
from tests.operator.conftest import kmock_info
from tests.operator.test_operator_kmock import POOL
from tests.support.tls import identity_dir
from tests.support.waiting import async_wait_until
from .kopf_run import start_operator

OPERATOR_TLS = str(identity_dir("operator", "operator"))  # the router lets operators steer workers

ROOT = Path(__file__).resolve().parents[2]
# GAIE's CRD is not part of this repository (Flotilla does not bundle it): the test reads a release's file from
# FLOTILLA_GAIE_CRD, .cache/gaie/ or ../shared/gaie/ (config/crd/bases/inference.networking.k8s.io_inferencepools.yaml
# of v1.6.0).
# The steering repository's shared/ (beside the checkout, as CI lays it) may hold it as a data file too.
_CRD_FILE = "gaie/v1.6.0/inference.networking.k8s.io_inferencepools.yaml"
_CANDIDATES = [Path(os.environ["FLOTILLA_GAIE_CRD"])] if os.environ.get("FLOTILLA_GAIE_CRD") else [
    ROOT / ".cache" / _CRD_FILE, ROOT.parent / "shared" / _CRD_FILE]
GAIE_CRD = next((path for path in _CANDIDATES if path.exists()), _CANDIDATES[0])
TARGET = gaie.GatewayTarget(selector={"app.kubernetes.io/instance": "flotilla",
                                      "app.kubernetes.io/component": "gateway"}, port=8080, mode="auto")
GAIE_RESOURCE = f"{gaie.GROUP}/{gaie.VERSION}/{gaie.PLURAL}"
GAIE_KEY = (kmock.resource(GAIE_RESOURCE), "ns1", "tiny")
DEPLOYMENT = (kmock.resource("apps/v1/deployments"), "ns1", "decode-a-workers")


def gaie_validator() -> jsonschema.Draft4Validator:
    if not GAIE_CRD.exists():
        pytest.skip(f"GAIE's InferencePool CRD not at {GAIE_CRD} (set FLOTILLA_GAIE_CRD)")
    crd = yaml.safe_load(GAIE_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == gaie.VERSION]
    assert crd["spec"]["group"] == gaie.GROUP and crd["spec"]["names"]["kind"] == gaie.KIND
    return jsonschema.Draft4Validator(_json_schema(version["schema"]["openAPIV3Schema"]))


def built(target: gaie.GatewayTarget = TARGET) -> dict:
    body = {"metadata": {"name": "decode-a", "namespace": "ns1", "uid": "u1"}}
    return gaie.inference_pool(body, parse_spec(POOL["spec"]), target)


def test_pool_per_model_selects_the_gateway_pods_and_is_valid_v1():
    pool = built()
    gaie_validator().validate(pool)
    assert pool["spec"]["selector"] == {"matchLabels": TARGET.selector}
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["metadata"]["name"] == "tiny" and pool["metadata"]["ownerReferences"][0]["kind"] == "FlotillaPool"
    with_picker = built(gaie.GatewayTarget(selector=TARGET.selector, endpoint_picker="flotilla-epp:9002"))
    gaie_validator().validate(with_picker)
    assert with_picker["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "flotilla-epp",
                                                        "port": {"number": 9002}}


def test_schema_refuses_what_v1_refuses():
    validator = gaie_validator()
    for broken in ({"targetPorts": []}, {"selector": {"matchLabels": {}}}, {"appProtocol": "grpc"}):
        pool = built()
        pool["spec"].update(broken)
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(pool)


@pytest.mark.parametrize("served", [True, False])
async def test_operator_applies_it_only_where_gaie_is_served(kube, router, served):
    if served:
        kube.resources[GAIE_RESOURCE] = kmock_info(gaie.KIND)
    registry = kopf.OperatorRegistry()
    register_handlers(registry, OperatorConfig(router_address=router.address, interval_s=0.2,
                                               kube_host=str(kube.url).rstrip("/"), gateway=TARGET,
                                               tls_dir=OPERATOR_TLS, worker_tls_secret="flotilla-tls-worker"))
    operator = start_operator(registry)
    try:
        await kube.post("/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools", json=POOL)
        await async_wait_until(lambda: DEPLOYMENT in kube.objects, 20, "the worker Deployment")
        if served:
            await async_wait_until(lambda: GAIE_KEY in kube.objects, 20, "the GAIE InferencePool")
            applied = kube.objects[GAIE_KEY].raw
            assert applied["spec"]["selector"]["matchLabels"] == TARGET.selector
            if GAIE_CRD.exists():
                gaie_validator().validate(applied)
        else:
            assert not [key for key in kube.objects if key[0].group == gaie.GROUP]
    finally:
        await operator.stop(10)
