"""Writes values.schema.json (run after changing values.yaml's shape): one schema for every role block, so
prefill and decode (and gateway, router, operator) cannot drift apart."""

import json
from pathlib import Path

IMAGE = {
    "type": "object", "required": ["repository", "tag"], "additionalProperties": False,
    "properties": {
        "repository": {"type": "string", "minLength": 1},
        "tag": {"type": "string", "minLength": 1, "not": {"const": "latest"},
                "description": "a pinned tag; latest is refused"},
    },
}
# Redis 7.4.6 fixes CVE-2024-46981, CVE-2025-21605 and CVE-2025-49844: older 7.x tags are refused.
REDIS_IMAGE = {**IMAGE, "properties": {**IMAGE["properties"], "tag": {
    "type": "string", "pattern": r"^(7\.4\.([6-9]|[1-9][0-9])|7\.([5-9]|[1-9][0-9])\.[0-9]+|([8-9]|[1-9][0-9])\.[0-9]+\.[0-9]+)(-[a-z0-9.]+)?$",
    "description": ">= 7.4.6"}}}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
TLS_ROLES = ("gateway", "router", "worker", "operator")  # one certificate each (flotilla/rpc/certs.py)
HOSTNAME = {"type": "string", "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
PATH = {"type": "string", "pattern": "^/"}
GO_DURATION = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"  # Gateway API's Duration (GEP-2257)
SELECTOR_PAIR = {"type": "object", "additionalProperties": False, "required": ["namespaceSelector", "podSelector"],
                 "properties": {"namespaceSelector": {"type": "object"}, "podSelector": {"type": "object"}}}
RESOURCES = {
    "type": "object", "additionalProperties": False,
    "properties": {k: {"type": "object", "additionalProperties": {"type": ["string", "integer", "number"]}}
                   for k in ("limits", "requests")},
}
AUTOSCALING = {
    "type": "object", "required": ["enabled"],
    "properties": {
        "enabled": {"type": "boolean"},
        "minReplicas": {"type": "integer", "minimum": 0}, "maxReplicas": {"type": "integer", "minimum": 1},
        "warmReplicas": {"type": "integer", "minimum": 0},
        "queuedTokensPerReplica": {"type": "integer", "minimum": 1},
        "kvUtilisation": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "ttftP95Seconds": {"type": "number", "exclusiveMinimum": 0},
        "scaleUpCooldownSeconds": {"type": "number", "minimum": 0},
        "scaleDownCooldownSeconds": {"type": "number", "minimum": 0},
        "scaleToZeroAfterIdleSeconds": {"type": "number", "minimum": 0},
        "targetCPUUtilizationPercentage": {"type": "integer", "minimum": 1, "maximum": 100},
    },
    "additionalProperties": False,
}
ROLE = {
    "type": "object",
    "required": ["enabled", "replicas", "image", "resources", "autoscaling", "monitoring", "podDisruptionBudget",
                 "extraEnv", "extraArgs"],
    "properties": {
        "enabled": {"type": "boolean"},
        "replicas": {"type": "integer", "minimum": 0},
        "image": IMAGE,
        "resources": RESOURCES,
        "autoscaling": AUTOSCALING,
        "monitoring": {"type": "object", "additionalProperties": False, "properties": {
            "serviceMonitor": {"type": "boolean"}, "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"}}},
        "podDisruptionBudget": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"}, "minAvailable": {"type": ["integer", "string"]}}},
        "extraEnv": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "extraArgs": {"type": "array", "items": {"type": "string"}},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "metricsPort": {"type": "integer", "minimum": 1, "maximum": 65535},
        "intervalSeconds": {"type": "number", "exclusiveMinimum": 0},
        "targetTpotMs": {"type": ["string", "number"], "pattern": "^(auto|off|[0-9]+(\\.[0-9]+)?)$", "minimum": 0,
                         "description": "worker --target-tpot-ms: auto, off, or milliseconds"},
        "degradation": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"}, "onsetSeconds": {"type": "number", "minimum": 0},
            "freeMaxTokens": {"type": "integer", "minimum": 1},
            "minQuotaFraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "queueLoadIntervalSeconds": {"type": "number", "exclusiveMinimum": 0}}},
        "rbac": {"type": "object", "properties": {"create": {"type": "boolean"}}, "additionalProperties": False},
        "watchNamespaces": {"type": "array", "uniqueItems": True,
                            "items": {"type": "string", "pattern": r"^[a-z0-9*?]([-a-z0-9*?]*[a-z0-9*?])?$"}},
        "podPolicy": {"type": "object", "additionalProperties": False, "properties": {
            "extraImages": {"type": "array", "items": {"type": "string", "pattern": r"^[^:@\s]+(:[0-9]+/[^:@\s]+)?$",
                                                       "description": "a repository, without tag or digest"}},
            "allowHostPath": {"type": "boolean"}}},
        "gatewayApiInferencePool": {"type": "object", "additionalProperties": False, "properties": {
            "mode": {"enum": ["auto", "on", "off"]},
            "endpointPicker": {"type": "string", "pattern": "^([a-z0-9-]+(:[0-9]+)?)?$"}}},
    },
    "additionalProperties": False,
}
# A model's own overrides of the chart-wide prefill/decode blocks: what may differ between two models' pools.
# Its autoscaling block may name single keys (the rest come from the chart-wide block).
POOL_OVERRIDE = {"type": "object", "additionalProperties": False, "properties": {
    **{k: ROLE["properties"][k] for k in ("enabled", "replicas", "image", "resources", "podDisruptionBudget",
                                          "extraEnv", "extraArgs", "targetTpotMs")},
    "autoscaling": {k: v for k, v in AUTOSCALING.items() if k != "required"}}}
LONG_CONTEXT_KEYS = {
    **{k: ROLE["properties"][k] for k in ("enabled", "replicas", "image", "resources", "podDisruptionBudget",
                                          "extraEnv", "extraArgs")},
    "thresholdTokens": {"type": "integer", "minimum": 1},
    "maxNumBatchedTokens": {"type": "integer", "minimum": 1},
    "kvCacheMemoryBytes": {"type": "integer", "minimum": 0, "description": "0: the device default"},
    "maxModelLen": {"type": "integer", "minimum": 0, "description": "0: the checkpoint's context window"},
    "autoscaling": {k: v for k, v in AUTOSCALING.items() if k != "required"},  # the pool's own signals
}
LONG_CONTEXT = {"type": "object", "additionalProperties": False, "properties": LONG_CONTEXT_KEYS,
                "required": ["enabled", "replicas", "thresholdTokens", "maxNumBatchedTokens", "image"]}
LONG_CONTEXT_OVERRIDE = {"type": "object", "additionalProperties": False, "properties": LONG_CONTEXT_KEYS}
MODEL = {"type": "object", "required": ["name", "checkpoint"], "additionalProperties": False,
         "properties": {"name": {"type": "string", "minLength": 1},
                        "checkpoint": {"type": "string", "minLength": 1},
                        "pool": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,28}[a-z0-9])?$",
                                 "description": "slug in the pool names (default: the name as a DNS label)"},
                        "volume": {"type": "object"}, "mountPath": {"type": "string"},
                                                "prefill": POOL_OVERRIDE, "decode": POOL_OVERRIDE, "longContext": LONG_CONTEXT_OVERRIDE}}
SHARED_POOL = {"type": "object", "additionalProperties": False, "required": ["enabled", "models"], "properties": {
    "enabled": {"type": "boolean"},
    "models": {"type": "array", "items": {"type": "object", "required": ["name", "checkpoint"],
                                          "additionalProperties": False, "properties": {
                                              "name": {"type": "string", "pattern": "^[^=,@\\s]+$"},
                                              "checkpoint": {"type": "string", "pattern": "^[^=,\\s]+$"}}}},
    "replicas": {"type": "integer", "minimum": 0},
    "maxLoadedModels": {"type": "integer", "minimum": 1},
    "image": IMAGE, "resources": RESOURCES, "volume": {"type": "object"}, "mountPath": {"type": "string"},
    "extraEnv": ROLE["properties"]["extraEnv"], "extraArgs": ROLE["properties"]["extraArgs"]},
    # Enabled, it needs two models or more (one model is a plain pool).
    "if": {"properties": {"enabled": {"const": True}}},
    "then": {"properties": {"models": {"minItems": 2}}}}
SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["models", "gateway", "router", "prefill", "decode", "operator"],
    "additionalProperties": False,
    "properties": {
        "models": {"type": "array", "minItems": 1, "items": MODEL},
        "sharedPool": SHARED_POOL,
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        **{role: ROLE for role in ("gateway", "router", "prefill", "decode", "operator")},
        "longContext": LONG_CONTEXT,
        "ingress": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"}, "className": {"type": "string"},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "hosts": {"type": "array", "items": HOSTNAME}, "path": PATH,
            "tls": {"type": "object", "additionalProperties": False,
                    "properties": {"secretName": {"type": "string"}}}}},
        "httpRoute": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"},
            "parentRefs": {"type": "array", "maxItems": 32, "items": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {k: {"type": "string", "minLength": 1} for k in
                               ("group", "kind", "namespace", "name", "sectionName")} | {"port": PORT}}},
            "hostnames": {"type": "array", "maxItems": 16, "items": HOSTNAME}, "path": PATH,
            "timeouts": {"type": "object", "additionalProperties": False, "properties": {
                k: {"type": "string", "pattern": GO_DURATION} for k in ("request", "backendRequest")}}}},
        "kvTransfer": {"type": "object", "additionalProperties": False, "properties": {
            "ucx": {"type": "object", "additionalProperties": False, "required": ["netDevices"], "properties": {
                "netDevices": {"type": "string", "pattern": r"^(all|[A-Za-z0-9_.-]+(:[0-9]+)?(,[A-Za-z0-9_.-]+(:[0-9]+)?)*)$"},
                "transports": {"type": "string", "pattern": r"^(\^?[a-z0-9_]+(,[a-z0-9_]+)*)?$"}}}}},
        "internalTLS": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"},
            "secrets": {"type": "object", "additionalProperties": False,
                        "properties": {role: {"type": "string"} for role in TLS_ROLES}},
            "certificates": {"type": "object", "additionalProperties": False, "properties": {
                "ca.crt": {"type": "string", "minLength": 1},
                **{role: {"type": "object", "additionalProperties": False, "required": ["tls.crt", "tls.key"],
                          "properties": {k: {"type": "string", "minLength": 1} for k in ("tls.crt", "tls.key")}}
                   for role in TLS_ROLES}}},
            "certManager": {"type": "object", "additionalProperties": False, "properties": {
                "enabled": {"type": "boolean"},
                "issuerRef": {"type": "object", "additionalProperties": False, "properties": {
                    k: {"type": "string"} for k in ("name", "kind", "group")}},
                "duration": {"type": "string", "pattern": GO_DURATION},
                "renewBefore": {"type": "string", "pattern": GO_DURATION},
                "workerIdentity": {"enum": ["pool", "release"],
                                   "description": "one worker Certificate per pool, or one for the release"}}}}},
        "leases": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"}, "existingSecret": {"type": "string"},
            "secret": {"type": "string", "anyOf": [{"maxLength": 0}, {"minLength": 16}],
                       "description": "empty (random) or at least 16 characters"}}},
        "keys": {"type": "object", "additionalProperties": False, "properties": {
            "existingSecret": {"type": "string"}, "keysJson": {"type": "string"},
            "limits": {"type": "object", "properties": {"maxBodyBytes": {"type": "integer", "minimum": 1}}}}},
        "networkPolicy": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"},
            "gatewayFrom": {"type": "array", "items": {"type": "object"}},
            "prometheus": SELECTOR_PAIR, "dns": SELECTOR_PAIR,
            "apiServer": {"type": "object", "additionalProperties": False, "properties": {
                "to": {"type": "array", "items": {"type": "object"}},
                "ports": {"type": "array", "minItems": 1, "items": PORT}}},
            "externalRedis": {"type": "object", "additionalProperties": False, "properties": {
                "to": {"type": "array", "items": {"type": "object"}}, "port": PORT}}}},
        "grafana": {"type": "object", "additionalProperties": False, "properties": {
            "dashboard": {"type": "boolean"}, "sidecarLabel": {"type": "string", "minLength": 1}}},
        "usageLedger": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"}, "mountPath": PATH, "volume": {"type": "object"}}},
        "redis": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"}, "image": REDIS_IMAGE, "resources": RESOURCES,
            "maxmemory": {"type": "string", "pattern": "^[0-9]+(b|kb|mb|gb)?$"},
            "auth": {"type": "object", "additionalProperties": False, "properties": {
                "existingSecret": {"type": "string"}, "key": {"type": "string", "minLength": 1}}},
            "persistence": {"type": "object", "additionalProperties": False, "properties": {
                "enabled": {"type": "boolean"}, "size": {"type": "string", "minLength": 1},
                "storageClass": {"type": "string"}}},
            "url": {"type": "string", "pattern": "^(rediss?://[^@]*$)?$",
                    "description": "no credentials (user@): put such a URL in urlSecret"},
            "urlSecret": {"type": "string"}}},
    },
}

if __name__ == "__main__":
    path = Path(__file__).with_name("values.schema.json")
    path.write_text(json.dumps(SCHEMA, indent=2) + "\n")
