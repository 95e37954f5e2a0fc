"""The real kopf operator against kmock and a real router: a FlotillaModelRoute sets the model's alias and rollout
in the router, a changed spec changes the weight, and currentVersion promotes the candidate; the status follows."""

from __future__ import annotations

import kmock
import kopf

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers

from tests.support.tls import identity_dir
from tests.support.waiting import async_wait_until
from .conftest import MODEL
from .kopf_run import start_operator

OPERATOR_TLS = str(identity_dir("operator", "operator"))  # only operators change routes
ROUTES = "/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillamodelroutes"
ROUTE_KEY = (kmock.resource("flotilla.dev/v1alpha1/flotillamodelroutes"), "ns1", "tiny-route")


def router_route(workers) -> tuple[rpb.ModelRoute | None, dict[str, str]]:
    listed = workers.operator.ListModelRoutes(rpb.ListModelRoutesRequest(), timeout=5)
    return next((r for r in listed.routes if r.name == MODEL), None), {a.alias: a.target for a in listed.aliases}


def status(kube, *keys):
    if ROUTE_KEY not in kube.objects:
        return None
    value = kube.objects[ROUTE_KEY].raw.get("status", {})
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


async def test_model_route_rolls_out_grows_and_promotes(kube, router, workers):
    workers.add("w-v1")  # version v1: the first version, current
    assert router_route(workers)[0].current_version == "v1"
    v2 = rpb.WorkerInfo(worker_id="w-v2", address="127.0.0.1:9", role=pb.WORKER_ROLE_DECODE,
                        model=pb.ModelInfo(name=MODEL, version="v2", max_model_len=2048))
    workers.stub.RegisterWorker(rpb.RegisterWorkerRequest(worker=v2), timeout=5)
    registry = kopf.OperatorRegistry()
    register_handlers(registry, OperatorConfig(router_address=router.address, interval_s=0.2,
                                               kube_host=str(kube.url).rstrip("/"), tls_dir=OPERATOR_TLS,
                                               worker_tls_secret="flotilla-tls-worker"))
    operator = start_operator(registry)
    try:
        await kube.post(ROUTES, json={
            "apiVersion": "flotilla.dev/v1alpha1", "kind": "FlotillaModelRoute",
            "metadata": {"name": "tiny-route", "namespace": "ns1", "uid": "uid-route", "resourceVersion": "1"},
            "spec": {"model": MODEL, "aliases": ["chat"], "rollout": {"version": "v2", "weightPercent": 10}}})
        await async_wait_until(lambda: router_route(workers)[0].candidate_weight_percent == 10, 20, "the rollout")
        assert router_route(workers)[1] == {"chat": MODEL}
        await async_wait_until(lambda: status(kube, "candidateVersion") == "v2", 20, "status")

        await kube.patch(f"{ROUTES}/tiny-route", json={"spec": {"rollout": {"version": "v2", "weightPercent": 50}}})
        await async_wait_until(lambda: router_route(workers)[0].candidate_weight_percent == 50, 20, "weight 50")

        await kube.patch(f"{ROUTES}/tiny-route", json={"spec": {"currentVersion": "v2"}})
        await async_wait_until(lambda: router_route(workers)[0].current_version == "v2", 20, "the promotion")
        route = router_route(workers)[0]
        assert (route.candidate_version, route.previous_version) == ("", "v1")
        await async_wait_until(lambda: status(kube, "currentVersion") == "v2", 20, "status after promotion")
        assert status(kube, "blocked") is None
    finally:
        await operator.stop(20)
        workers.stub.DeregisterWorker(rpb.DeregisterWorkerRequest(worker_id="w-v2"), timeout=5)
