"""GetPoolSignals, pure over the registry, the queue and the traffic window: one model's load by state."""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.registry import WorkerEntry, WorkerRegistry
from flotilla.router.traffic import TrafficWindow

DEFAULT_WINDOW_S = 30.0


def pool_signals(
    request: rpb.GetPoolSignalsRequest,
    registry: WorkerRegistry,
    traffic: TrafficWindow,
    num_queued_requests: int,
    num_queued_prompt_tokens: int,
) -> rpb.GetPoolSignalsResponse:
    window_s = request.window_s if request.window_s > 0 else DEFAULT_WINDOW_S
    entries = [e for e in registry.workers() if _in_pool(e, request)]
    active = [e for e in entries if e.state == rpb.WORKER_STATE_ACTIVE and registry.is_healthy(e)]
    snapshot = traffic.snapshot(request.model, window_s)
    return rpb.GetPoolSignalsResponse(
        num_active=len(active),
        num_warm=sum(e.state == rpb.WORKER_STATE_WARM for e in entries),
        num_draining=sum(e.state == rpb.WORKER_STATE_DRAINING for e in entries),
        num_queued_requests=num_queued_requests,
        num_queued_tokens=num_queued_prompt_tokens + sum(e.report.num_queued_tokens for e in active),
        num_used_blocks=sum(e.report.num_total_blocks - e.report.num_free_blocks for e in active),
        num_total_blocks=sum(e.report.num_total_blocks for e in active),
        ttft_p95_s=snapshot.ttft_p95_s,
        num_ttft_samples=snapshot.num_ttft_samples,
        num_prompt_tokens=snapshot.num_prompt_tokens,
        num_output_tokens=snapshot.num_output_tokens,
        window_s=window_s,
        seconds_since_last_request=snapshot.seconds_since_last_request,
    )


def _in_pool(entry: WorkerEntry, request: rpb.GetPoolSignalsRequest) -> bool:
    if entry.model_name != request.model:
        return False
    return request.role == pb.WORKER_ROLE_UNSPECIFIED or entry.info.role == request.role
