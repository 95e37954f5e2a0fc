"""A small evaluator of Kubernetes NetworkPolicy semantics (networking.k8s.io/v1), enough for the chart's
policies: a connection src -> dst:port is allowed when dst is not isolated for ingress or an ingress rule of a
policy selecting it admits src and the port, and src is not isolated for egress or an egress rule of a policy
selecting it admits dst and the port. Named ports resolve on the destination's container ports. Endpoints
outside the cluster (the API server) are matched by ipBlock or by a rule without peers."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Port:
    number: int
    name: str = ""
    protocol: str = "TCP"


@dataclass
class Endpoint:
    name: str
    namespace: str | None  # None: outside the cluster (matched by ipBlock only)
    labels: dict[str, str] = field(default_factory=dict)
    ports: list[Port] = field(default_factory=list)
    ip: str = "10.0.0.1"

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace} if self.namespace else {}


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _peer_matches(peer: dict, endpoint: Endpoint, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(endpoint.ip)
        return (address in ipaddress.ip_network(block["cidr"]) and
                not any(address in ipaddress.ip_network(c) for c in block.get("except", [])))
    if endpoint.namespace is None:
        return False  # pod and namespace selectors match pods only
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], endpoint.namespace_labels):
            return False
    elif endpoint.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), endpoint.labels)


def _port_matches(rule_ports: list[dict] | None, port: Port) -> bool:
    if not rule_ports:
        return True
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != port.protocol:
            continue
        wanted = entry.get("port")
        if wanted is None or wanted == port.number or (isinstance(wanted, str) and wanted == port.name):
            return True
        if isinstance(wanted, int) and entry.get("endPort") and wanted <= port.number <= entry["endPort"]:
            return True
    return False


def _admits(policies: list[dict], subject: Endpoint, direction: str, peer: Endpoint, port: Port) -> bool:
    kind, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [p for p in policies if subject.namespace == p["metadata"]["namespace"]
                 and selects(p["spec"]["podSelector"], subject.labels)
                 and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True  # not isolated in this direction
    for policy in selecting:
        for rule in policy["spec"].get(kind) or []:
            peers = rule.get(peers_key)
            if peers is not None and not any(_peer_matches(x, peer, policy["metadata"]["namespace"]) for x in peers):
                continue
            if _port_matches(rule.get("ports"), port):
                return True
    return False


def allowed(policies: list[dict], src: Endpoint, dst: Endpoint, port: Port) -> bool:
    return (_admits(policies, dst, "Ingress", src, port) and _admits(policies, src, "Egress", dst, port))
