"""The real kopf operator against kmock: a prefill pool follows the decode pool of its model by the
prefill:decode ratio of the measured token mix. The router here is a stand-in gRPC RouterService (real
gRPC, real RouterClient) that reports a fixed token mix: the real router only measures one from requests
relayed to real workers, which this test has none of."""

from __future__ import annotations

import copy
from concurrent import futures

import grpc
import kmock
import kopf
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers

from tests.support.waiting import async_wait_until

from .kopf_run import start_operator
from .test_operator_kmock import POOL, _get

NUM_DECODE = 3
# 6000 prompt / 1000 output tokens at 4000 / 1000 tokens/s per replica: ratio 1.5 -> ceil(3 x 1.5) = 5.
MIX = {"num_prompt_tokens": 6000, "num_output_tokens": 1000}


class StandInRouter(router_pb2_grpc.RouterServiceServicer):
    """Decode workers are all active; no prefill worker registered yet; the same token mix for every role."""

    def ListWorkers(self, request, context):
        return rpb.ListWorkersResponse()

    def SetWorkerState(self, request, context):
        return rpb.SetWorkerStateResponse()

    def GetPoolSignals(self, request, context):
        num_active = NUM_DECODE if request.role == pb.WORKER_ROLE_DECODE else 0
        return rpb.GetPoolSignalsResponse(num_active=num_active, window_s=request.window_s, **MIX)


@pytest.fixture()
def router_address():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    router_pb2_grpc.add_RouterServiceServicer_to_server(StandInRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def pool(name: str, role: str, replicas: dict) -> dict:
    body = copy.deepcopy(POOL)
    body["metadata"].update(name=name, uid=f"uid-{name}")
    body["spec"]["role"] = role
    body["spec"]["replicas"] = replicas
    body["spec"]["scaling"].update(prefillTokensPerSecond=4000, decodeTokensPerSecond=1000)
    return body


def keys(name: str):
    return ((kmock.resource("apps/v1/deployments"), "ns1", f"{name}-workers"),
            (kmock.resource("flotilla.dev/v1alpha1/flotillapools"), "ns1", name))


async def test_prefill_pool_scales_to_the_ratio_of_the_decode_pool(kube, router_address):
    registry = kopf.OperatorRegistry()
    register_handlers(registry, OperatorConfig(router_address=router_address, interval_s=0.2,
                                               kube_host=str(kube.url).rstrip("/"), insecure_internal=True))
    operator = start_operator(registry)
    prefill_deployment, prefill_pool = keys("prefill-a")
    try:
        # Alone, the prefill pool holds its own minimum: there is no decode pool to follow.
        await kube.post("/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools",
                        json=pool("prefill-a", "prefill", {"min": 1, "max": 8, "warm": 0}))
        await async_wait_until(lambda: _get(kube, prefill_pool, "status", "lastDecision", "time") is not None, 20,
                               "the prefill pool's first decision")
        assert _get(kube, prefill_deployment, "spec", "replicas") == 1
        assert "ratio" not in _get(kube, prefill_pool, "status", "lastDecision", "reason")

        # A decode pool of the model at 3 active replicas: the prefill pool grows to the ratio's 5.
        await kube.post("/apis/flotilla.dev/v1alpha1/namespaces/ns1/flotillapools",
                        json=pool("decode-a", "decode", {"min": NUM_DECODE, "max": 6, "warm": 0}))
        await async_wait_until(lambda: _get(kube, keys("decode-a")[1], "status", "activeReplicas") == NUM_DECODE,
                               20, "the decode pool's status")
        await async_wait_until(lambda: _get(kube, prefill_deployment, "spec", "replicas") == 5, 20,
                               "the prefill Deployment at the ratio's 5 replicas")

        def last_reason() -> str:
            return _get(kube, prefill_pool, "status", "lastDecision", "reason") or ""

        await async_wait_until(lambda: "ratio 1.50" in last_reason(), 20,
                               "the ratio in the prefill pool's last decision")
        status = kube.objects[prefill_pool].raw["status"]
        assert (status["desiredReplicas"], status["activeReplicas"]) == (5, 5)
        assert f"x {NUM_DECODE} decode -> at least 5" in status["lastDecision"]["reason"]
        assert status["signals"]["promptTokens"] == 6000 and status["signals"]["outputTokens"] == 1000
    finally:
        await operator.stop(20)
