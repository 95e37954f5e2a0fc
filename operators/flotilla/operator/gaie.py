"""The Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1), one per served model,
selecting the gateway pods: any GAIE gateway (Istio, kgateway, NGINX Gateway Fabric, GKE, ...) can then route
to Flotilla. Pure builders; the operator applies them from decode/both pools (prefill pools serve no client)
when the GAIE CRD is installed, or always when configured so. GAIE's CRDs are never installed by Flotilla."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from flotilla.operator.manifests import owner_reference
from flotilla.operator.pool_spec import PoolSpec

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
KIND = "InferencePool"
MODEL_LABEL = "flotilla.dev/model"
SERVING_ROLES = ("decode", "both")


@dataclass(frozen=True)
class GatewayTarget:
    """The gateway pods a GAIE pool selects and their HTTP port; optionally a GAIE endpoint picker Service."""
    selector: dict[str, str] = field(default_factory=dict)
    port: int = 8080
    endpoint_picker: str = ""  # "name:port" of an endpoint picker Service; "" : none
    mode: str = "auto"  # auto: when the CRD is installed; on: always; off: never

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"GAIE mode must be auto, on or off, not {self.mode!r}")
        if self.mode != "off" and not self.selector:
            raise ValueError("a GAIE InferencePool needs the gateway pods' labels (FLOTILLA_GATEWAY_SELECTOR)")


def pool_name(model_name: str) -> str:
    """A DNS-1123 name from a model name ("Llama-3.1_8B" -> "llama-3.1-8b")."""
    name = re.sub(r"[^a-z0-9.-]+", "-", model_name.lower()).strip("-.")
    if not name:
        raise ValueError(f"model name {model_name!r} gives no valid object name")
    return name[:253]


def inference_pool(body: dict[str, Any], spec: PoolSpec, target: GatewayTarget) -> dict[str, Any]:
    """Owned by the serving FlotillaPool (deleting it removes the GAIE pool, in a real cluster)."""
    meta = body["metadata"]
    pool_spec: dict[str, Any] = {
        "selector": {"matchLabels": dict(target.selector)},
        "targetPorts": [{"number": target.port}],
        "appProtocol": "http",
    }
    if target.endpoint_picker:
        name, _, port = target.endpoint_picker.partition(":")
        pool_spec["endpointPickerRef"] = {"kind": "Service", "name": name, "port": {"number": int(port or 9002)}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": pool_name(spec.model.name), "namespace": meta["namespace"],
            "labels": {"app.kubernetes.io/managed-by": "flotilla-operator", MODEL_LABEL: pool_name(spec.model.name)},
            "ownerReferences": [owner_reference(body)],
        },
        "spec": pool_spec,
    }
