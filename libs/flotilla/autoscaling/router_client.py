"""The router calls the autoscaler makes (blocking gRPC: the supervisor runs on its own thread).

With several routers (a comma list of addresses), a model's signals come from the router that owns it (its queue
and its TTFT samples are there: rpc/router_ownership.py), failing over to the next; the worker list from the first
that answers (every router has every worker); a worker state is set on every router, so that none places work on
a warm or draining worker."""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from flotilla.autoscaling.signals import PoolSignals, TokenMix
from flotilla.rpc.options import sync_channel
from flotilla.rpc.router_ownership import owner_order, split_addresses
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


T = TypeVar("T")


class RouterClient:
    def __init__(self, address: str | Sequence[str], tls: InternalTLS | None = None):
        """`address`: one router's host:port, or several (a comma list). `tls`: the operator's certificate (the
        router lets only operators steer workers)."""
        self._addresses = split_addresses(address)
        self._channels = {a: sync_channel(a, tls, "router") for a in self._addresses}
        self._stubs = {a: router_pb2_grpc.RouterServiceStub(channel) for a, channel in self._channels.items()}

    def signals(self, model: str, window_s: float, role: int = pb.WORKER_ROLE_UNSPECIFIED,
                pool: str = "") -> PoolSignals:
        """`pool`: "" every pool of the model; "default" or "long-context" that pool's workers and queue lane."""
        request = rpb.GetPoolSignalsRequest(model=model, role=role, window_s=window_s, pool=pool)
        return to_pool_signals(self._first_answer(owner_order(self._addresses, model),
                                                  lambda stub: stub.GetPoolSignals(request, timeout=CALL_TIMEOUT_S)))

    def workers(self, model: str) -> list[rpb.WorkerStatus]:
        response = self._first_answer(self._addresses,
                                      lambda stub: stub.ListWorkers(rpb.ListWorkersRequest(), timeout=CALL_TIMEOUT_S))
        return [status for status in response.workers if status.worker.model.name == model]

    def set_state(self, worker_id: str, state: int) -> rpb.SetWorkerStateResponse:
        """On every router; the first router's answer. Raises when one cannot be reached (the caller sets it
        again at its next tick)."""
        request = rpb.SetWorkerStateRequest(worker_id=worker_id, state=state)
        answers = [self._stubs[a].SetWorkerState(request, timeout=CALL_TIMEOUT_S) for a in self._addresses]
        return answers[0]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def _first_answer(self, addresses: Sequence[str], call: Callable[[router_pb2_grpc.RouterServiceStub], T]) -> T:
        for address in addresses[:-1]:
            try:
                return call(self._stubs[address])
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
        return call(self._stubs[addresses[-1]])
