"""A JSON Schema for the Gateway API HTTPRoute (gateway.networking.k8s.io/v1) objects the chart renders, written
here from the Gateway API v1 reference (no CRD file is vendored): the fields the chart can render, with the
spec's types, enums, patterns and list limits, unknown fields refused. Rules the CRD states in CEL are checked
in `cel_rules` (those that touch what the chart renders). FLOTILLA_GATEWAY_API_CRD, when set, names the real
CRD file (config/crd/standard/gateway.networking.k8s.io_httproutes.yaml) to validate against as well."""

from __future__ import annotations

import re

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DURATION = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"
GROUP = {"type": "string", "maxLength": 253, "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
NAMESPACE = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": DNS_LABEL}
OBJECT_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}

PARENT_REF = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"group": GROUP, "kind": KIND, "namespace": NAMESPACE, "name": OBJECT_NAME,
                   "sectionName": {"type": "string", "minLength": 1, "maxLength": 253, "pattern": DNS_SUBDOMAIN},
                   "port": PORT},
}
PATH_MATCH = {
    "type": "object", "additionalProperties": False,
    "properties": {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                   "value": {"type": "string", "maxLength": 1024}},
}
BACKEND_REF = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"group": GROUP, "kind": KIND, "namespace": NAMESPACE, "name": OBJECT_NAME, "port": PORT,
                   "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}},
}
RULE = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matches": {"type": "array", "maxItems": 64, "items": {
            "type": "object", "additionalProperties": False, "properties": {"path": PATH_MATCH}}},
        "backendRefs": {"type": "array", "maxItems": 16, "items": BACKEND_REF},
        "timeouts": {"type": "object", "additionalProperties": False, "properties": {
            "request": {"type": "string", "pattern": DURATION},
            "backendRequest": {"type": "string", "pattern": DURATION}}},
    },
}
HTTPROUTE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": {"type": "object", "required": ["name"]},  # ObjectMeta: checked by the caller
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "parentRefs": {"type": "array", "maxItems": 32, "items": PARENT_REF},
            "hostnames": {"type": "array", "maxItems": 16, "items": {
                "type": "string", "minLength": 1, "maxLength": 253,
                "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}},
            "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": RULE},
        }},
    },
}


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * units[u] for n, u in re.findall(r"([0-9]+)(ms|h|m|s)", duration))


def cel_rules(route: dict) -> list[str]:
    """The CRD's CEL rules on what the chart renders; each broken one as a message."""
    broken = []
    for rule in route["spec"].get("rules", []):
        for match in rule.get("matches", []):
            path = match.get("path", {})
            if path.get("type") in ("Exact", "PathPrefix") and not path.get("value", "/").startswith("/"):
                broken.append(f"path {path} must be an absolute path")
            if path.get("type") in ("Exact", "PathPrefix") and re.search(r"//|/\./|/\.\./|%2[fF]|#", path.get("value", "")):
                broken.append(f"path {path} must not contain //, /./, /../, %2f or #")
        for ref in rule.get("backendRefs", []):
            if ref.get("kind", "Service") == "Service" and ref.get("group", "") == "" and "port" not in ref:
                broken.append(f"backendRef {ref}: a Service needs a port")
        timeouts = rule.get("timeouts", {})
        if {"request", "backendRequest"} <= timeouts.keys() and _seconds(timeouts["request"]) and \
                _seconds(timeouts["backendRequest"]) > _seconds(timeouts["request"]):
            broken.append(f"timeouts {timeouts}: backendRequest must be <= request")
    return broken
