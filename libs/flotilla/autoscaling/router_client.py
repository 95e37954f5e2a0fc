"""The router calls the autoscaler makes (blocking gRPC: the supervisor runs on its own thread)."""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.autoscaling.signals import PoolSignals, TokenMix
from flotilla.rpc.options import sync_channel
from flotilla.rpc.tls import InternalTLS

CALL_TIMEOUT_S = 2.0


def to_pool_signals(response: rpb.GetPoolSignalsResponse) -> PoolSignals:
    return PoolSignals(
        num_active=response.num_active,
        num_warm=response.num_warm,
        num_draining=response.num_draining,
        num_queued_requests=response.num_queued_requests,
        num_queued_tokens=response.num_queued_tokens,
        num_used_blocks=response.num_used_blocks,
        num_total_blocks=response.num_total_blocks,
        ttft_p95_s=response.ttft_p95_s,
        num_prompt_tokens=response.num_prompt_tokens,
        num_output_tokens=response.num_output_tokens,
        seconds_since_last_request=max(0.0, response.seconds_since_last_request),
    )


def token_mix(signals: PoolSignals) -> TokenMix:
    return TokenMix(signals.num_prompt_tokens, signals.num_output_tokens)


class RouterClient:
    def __init__(self, address: str, tls: InternalTLS | None = None):
        """`tls`: the operator's certificate (the router lets only operators steer workers)."""
        self._channel = sync_channel(address, tls, "router")
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)

    def signals(self, model: str, window_s: float, role: int = pb.WORKER_ROLE_UNSPECIFIED) -> PoolSignals:
        request = rpb.GetPoolSignalsRequest(model=model, role=role, window_s=window_s)
        return to_pool_signals(self._stub.GetPoolSignals(request, timeout=CALL_TIMEOUT_S))

    def workers(self, model: str) -> list[rpb.WorkerStatus]:
        response = self._stub.ListWorkers(rpb.ListWorkersRequest(), timeout=CALL_TIMEOUT_S)
        return [status for status in response.workers if status.worker.model.name == model]

    def set_state(self, worker_id: str, state: int) -> rpb.SetWorkerStateResponse:
        request = rpb.SetWorkerStateRequest(worker_id=worker_id, state=state)
        return self._stub.SetWorkerState(request, timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        self._channel.close()
