"""router.replicas: 2 renders a StatefulSet of two routers with a headless Service, and every router address
reaches whoever dials routers: the gateway's --router, each pool's routerAddress (the workers' --router, as the
operator builds their pods), the operator's FLOTILLA_ROUTER_ADDRESS (qualified when pools live in other
namespaces). One replica keeps the router Service's address."""

from __future__ import annotations

from flotilla.cli.router_flags import router_addresses
from flotilla.operator.pool_spec import KIND
from tests.chart.rendering import NAMESPACE, needs_helm, operator_env, rendered_case, worker_deployments

pytestmark = needs_helm
TWO = [f"flotilla-router-{i}.flotilla-router-headless:50050" for i in range(2)]


def gateway_router_flag(docs) -> tuple[str, ...]:
    (gateway,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "flotilla-gateway"]
    args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    return router_addresses([a.removeprefix("--router=") for a in args if a.startswith("--router=")])


def test_two_routers_are_a_statefulset_behind_a_headless_service_and_everyone_dials_both():
    docs = rendered_case("default", "--set", "router.replicas=2")
    (router,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "flotilla-router"]
    assert router["spec"]["replicas"] == 2 and router["spec"]["serviceName"] == "flotilla-router-headless"
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "flotilla-router-headless"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert list(gateway_router_flag(docs)) == TWO
    assert [router_addresses(p["spec"]["routerAddress"]) for p in docs if p["kind"] == KIND] == [tuple(TWO)]
    (worker,) = worker_deployments(docs)
    args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert list(router_addresses(args[args.index("--router") + 1])) == TWO
    assert operator_env(docs)["FLOTILLA_ROUTER_ADDRESS"] == ",".join(TWO)


def test_pools_in_other_namespaces_get_every_routers_full_name():
    docs = rendered_case("default", "--set", "router.replicas=2", "--set", "operator.watchNamespaces={team-a}")
    assert operator_env(docs)["FLOTILLA_ROUTER_ADDRESS"] == ",".join(
        f"flotilla-router-{i}.flotilla-router-headless.{NAMESPACE}.svc:50050" for i in range(2))


def test_one_router_keeps_the_services_address():
    docs = rendered_case("default")
    assert gateway_router_flag(docs) == ("flotilla-router:50050",)
