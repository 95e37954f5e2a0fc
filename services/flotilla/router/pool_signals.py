"""GetPoolSignals, pure over the registry, the queue and the traffic window: one model's load by state; with a pool
("default", "long-context"), that pool's workers only (the caller passes its queue lane's figures). TTFT is
measured per model, mostly on short prompts: the default pool's signals carry it, the long-context pool's none (it
scales on its own queue and KV; a long prompt's first token is slow by nature)."""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.context_pools import LONG_CONTEXT_POOL, pool_label
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
    ttft = request.pool != LONG_CONTEXT_POOL
    return rpb.GetPoolSignalsResponse(
        num_active=len(active),
        num_warm=sum(e.state == rpb.WORKER_STATE_WARM for e in entries),
        num_draining=sum(e.state == rpb.WORKER_STATE_DRAINING for e in entries),
        num_queued_requests=num_queued_requests,
        num_queued_tokens=num_queued_prompt_tokens + sum(e.report.num_queued_tokens for e in active),
        num_used_blocks=sum(e.report.num_total_blocks - e.report.num_free_blocks for e in active),
        num_total_blocks=sum(e.report.num_total_blocks for e in active),
        ttft_p95_s=snapshot.ttft_p95_s if ttft else 0.0,
        num_ttft_samples=snapshot.num_ttft_samples if ttft else 0,
        num_prompt_tokens=snapshot.num_prompt_tokens,
        num_output_tokens=snapshot.num_output_tokens,
        window_s=window_s,
        seconds_since_last_request=snapshot.seconds_since_last_request,
    )


def _in_pool(entry: WorkerEntry, request: rpb.GetPoolSignalsRequest) -> bool:
    if entry.model_name != request.model or (request.pool and pool_label(entry.pool) != request.pool):
        return False
    return request.role == pb.WORKER_ROLE_UNSPECIFIED or entry.info.role == request.role
