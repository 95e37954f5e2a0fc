"""The rendered NetworkPolicies, evaluated (network_policy_model.py) over every pod of the release (the chart's
and the operator's worker pods, with their rendered labels and ports) and the endpoints around it (a client in
another namespace, another pod in the release's namespace, Prometheus, cluster DNS, the API server, an external
Redis): exactly the paths the design needs are open, every other pair is closed."""

from __future__ import annotations

import itertools

import pytest

from tests.chart.network_policy_model import Endpoint, Port, allowed
from tests.chart.rendering import CASES, NAMESPACE, needs_helm, rendered_case, workloads

pytestmark = needs_helm
UCX_PORT = Port(40000)  # NIXL/UCX's own TCP ports between workers: any port


def release_pods(docs) -> dict[str, Endpoint]:
    pods = {}
    for workload in workloads(docs):
        template = workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        name = labels.get("app.kubernetes.io/component") or labels["flotilla.dev/pool"].rsplit("-", 1)[-1] + "-worker"
        ports = [Port(p["containerPort"], p.get("name", ""), p.get("protocol", "TCP"))
                 for c in template["spec"]["containers"] for p in c.get("ports", [])]
        if name.endswith("-worker"):
            ports.append(UCX_PORT)
        pods[name] = Endpoint(name, NAMESPACE, labels, ports)
    return pods


def outside() -> dict[str, Endpoint]:
    return {
        "client": Endpoint("client", "clients", {"app": "curl"}),
        "neighbour": Endpoint("neighbour", NAMESPACE, {"app": "something-else"}),
        "prometheus": Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
        "kube-dns": Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"},
                             [Port(53, "dns", "UDP"), Port(53, "dns-tcp", "TCP")]),
        "apiserver": Endpoint("apiserver", None, ports=[Port(443), Port(6443)], ip="10.96.0.1"),
        "external-redis": Endpoint("external-redis", None, ports=[Port(6379)], ip="10.20.0.5"),
    }


def open_paths(docs) -> set[tuple[str, str, int, str]]:
    policies = [{**d, "metadata": {"namespace": NAMESPACE, **d["metadata"]}} for d in docs
                if d["kind"] == "NetworkPolicy"]
    pods, others = release_pods(docs), outside()
    everyone = {**pods, **others}
    paths = set()
    for src, dst in itertools.product(everyone.values(), repeat=2):
        if src.name not in pods and dst.name not in pods:
            continue  # neither end is the release's: its policies say nothing
        if src.name == dst.name and not src.name.endswith("-worker"):
            continue  # a pod to itself; a worker to itself stands for another replica of its pool
        for port in dst.ports:
            if allowed(policies, src, dst, port):
                paths.add((src.name, dst.name, port.number, port.protocol))
    return paths


def expected_paths(pods: set[str], redis: str | None, leases: bool = True) -> set[tuple[str, str, int, str]]:
    workers = sorted(p for p in pods if p.endswith("-worker"))
    paths = {(src, "gateway", 8080, "TCP") for src in outside()}  # networkPolicy.gatewayFrom empty: any source
    paths |= {("prometheus", service, 9090, "TCP") for service in ("gateway", "router", "operator")}
    paths |= {("gateway", "router", 50050, "TCP"), ("operator", "router", 50050, "TCP")}
    paths |= {("operator", "apiserver", 443, "TCP"), ("operator", "apiserver", 6443, "TCP")}
    for worker in workers:
        paths |= {(worker, "router", 50050, "TCP"), ("router", worker, 50051, "TCP"), ("prometheus", worker, 9091, "TCP")}
        if leases:  # placement leases (on by default): the gateway streams from the workers
            paths.add(("gateway", worker, 50051, "TCP"))
        for other in workers:  # KV transfer: gRPC, metrics port and UCX's own ports alike
            paths |= {(worker, other, port, "TCP") for port in (50051, 9091, UCX_PORT.number)}
    if redis == "chart":
        paths.add(("gateway", "redis", 6379, "TCP"))
    if redis == "external":
        paths.add(("gateway", "external-redis", 6379, "TCP"))
    paths |= {(pod, "kube-dns", 53, protocol) for pod in pods for protocol in ("UDP", "TCP")}
    return paths


@pytest.mark.parametrize("case", sorted(CASES))
def test_exactly_the_designed_paths_are_open(case):
    docs = rendered_case(case)
    pods = set(release_pods(docs))
    redis = "chart" if "redis" in pods else None
    assert {"gateway", "router", "operator", "decode-worker"} <= pods
    assert open_paths(docs) == expected_paths(pods, redis)


def test_external_redis_is_reachable_from_the_gateway_only():
    docs = rendered_case("default", "--set", "redis.urlSecret=managed-redis")
    assert open_paths(docs) == expected_paths(set(release_pods(docs)), "external")


def test_narrowed_gateway_sources_and_api_server():
    docs = rendered_case("default", "--set-json",
                         'networkPolicy.gatewayFrom=[{"namespaceSelector":{"matchLabels":'
                         '{"kubernetes.io/metadata.name":"clients"}}}]',
                         "--set-json", 'networkPolicy.apiServer.to=[{"ipBlock":{"cidr":"10.96.0.1/32"}}]')
    paths = open_paths(docs)
    assert ("client", "gateway", 8080, "TCP") in paths
    assert ("neighbour", "gateway", 8080, "TCP") not in paths
    assert ("operator", "apiserver", 443, "TCP") in paths
    assert ("operator", "external-redis", 6379, "TCP") not in paths


def test_without_leases_only_the_router_reaches_the_workers():
    docs = rendered_case("default", "--set", "leases.enabled=false")
    assert open_paths(docs) == expected_paths(set(release_pods(docs)), None, leases=False)


def test_disabled_renders_no_policy():
    docs = rendered_case("default", "--set", "networkPolicy.enabled=false")
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]
