"""The chart's operator env, read by the operator's own config loader, points GAIE InferencePools at exactly the
rendered gateway pods and port."""

from __future__ import annotations

import pytest

from flotilla.operator.config import OperatorConfig
from tests.chart.rendering import CASES, needs_helm, rendered_case

pytestmark = needs_helm


def deployment(docs, suffix: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith(suffix)]
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_selects_the_gateway_pods(case, monkeypatch):
    docs = rendered_case(case)
    operator = deployment(docs, "-operator")["spec"]["template"]["spec"]["containers"][0]
    for var in operator["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    target = OperatorConfig.from_env().gateway
    gateway = deployment(docs, "-gateway")["spec"]["template"]
    assert target.mode == "auto"
    assert target.selector and target.selector.items() <= gateway["metadata"]["labels"].items()
    assert target.port == gateway["spec"]["containers"][0]["ports"][0]["containerPort"]
