"""RouterService handlers: worker membership, model listing, and the relay of token streams."""

from __future__ import annotations

import logging
import time

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.rpc.convert import error_response
from flotilla.router.admission import Admission, Placement, RouterError, Ticket
from flotilla.router.models import aliases_of
from flotilla.router.registry import WorkerRegistry

logger = logging.getLogger(__name__)

# Worker call failures that mean the worker itself is gone, not that this one request went wrong.
_WORKER_GONE = (grpc.StatusCode.UNAVAILABLE,)


class RouterService(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self,
        registry: WorkerRegistry,
        admission: Admission,
        aliases: dict[str, str],
        heartbeat_interval_s: float,
    ):
        self._registry = registry
        self._admission = admission
        self._aliases = aliases
        self._heartbeat_interval_ms = int(heartbeat_interval_s * 1000)

    # ---- generation --------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if not request.request_id:
            await context.write(error_response(pb.ERROR_CODE_INVALID_REQUEST, "must not be empty", "request_id"))
            return
        try:
            placement = await self._admission.acquire(
                request.model, len(request.prompt_token_ids), request.deadline_unix_s, Ticket.of(request)
            )
        except RouterError as exc:
            refusal = error_response(exc.code, exc.message, exc.field)
            refusal.error.retry_after_s = exc.retry_after_s
            await context.write(refusal)
            return
        try:
            await self._relay(request, placement, context)
        finally:
            self._admission.dispatch()  # a finished request may have made room for a queued one

    async def _relay(
        self, request: pb.GenerateRequest, placement: Placement, context: grpc.aio.ServicerContext
    ) -> None:
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.model = placement.resolution.qualified
        worker = placement.worker
        worker.num_inflight += 1
        call = worker.stub.Generate(forwarded, timeout=_timeout(request.deadline_unix_s))
        try:
            async for response in call:
                await context.write(response)
        except grpc.aio.AioRpcError as exc:
            await context.write(self._worker_error(worker.worker_id, exc))
        finally:
            # No-op when the stream ended; when our caller went away this cancels the worker call, which
            # aborts the request in its engine.
            call.cancel()
            worker.num_inflight -= 1

    def _worker_error(self, worker_id: str, exc: grpc.aio.AioRpcError) -> pb.GenerateResponse:
        status = exc.code()
        if status in _WORKER_GONE:
            self._registry.mark_failed(worker_id)
            return error_response(pb.ERROR_CODE_UNAVAILABLE, f"worker {worker_id} unreachable", worker_id=worker_id)
        if status == grpc.StatusCode.DEADLINE_EXCEEDED:
            return error_response(pb.ERROR_CODE_DEADLINE_EXCEEDED, "deadline exceeded", worker_id=worker_id)
        logger.warning("worker %s failed a Generate call: %s %s", worker_id, status, exc.details())
        return error_response(pb.ERROR_CODE_INTERNAL, f"worker error: {status.name}", worker_id=worker_id)

    # ---- membership --------------------------------------------------------------------------------
    async def RegisterWorker(
        self, request: rpb.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> rpb.RegisterWorkerResponse:
        info = request.worker
        if not info.worker_id or not info.address or not info.model.name or not info.model.version:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id, address and model name/version needed")
        self._registry.register(info)
        self._admission.dispatch()
        return rpb.RegisterWorkerResponse(heartbeat_interval_ms=self._heartbeat_interval_ms)

    async def Heartbeat(
        self, request: rpb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> rpb.HeartbeatResponse:
        known = self._registry.heartbeat(request.worker_id, request.load)
        if known:
            self._admission.dispatch()
        return rpb.HeartbeatResponse(known=known)

    async def DeregisterWorker(
        self, request: rpb.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> rpb.DeregisterWorkerResponse:
        self._registry.deregister(request.worker_id)
        return rpb.DeregisterWorkerResponse()

    async def ListWorkers(
        self, request: rpb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ListWorkersResponse:
        statuses = [self._registry.status(entry) for entry in self._registry.workers()]
        return rpb.ListWorkersResponse(workers=sorted(statuses, key=lambda s: s.worker.worker_id))

    async def ListModels(
        self, request: rpb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ListModelsResponse:
        versions = self._registry.model_versions()
        models = []
        for ref in sorted(versions, key=lambda r: (r.name, -r.first_registered)):
            info = pb.ModelInfo()
            info.CopyFrom(self._registry.model_info(ref.name, ref.version))
            info.aliases[:] = aliases_of(ref, versions, self._aliases)
            models.append(info)
        return rpb.ListModelsResponse(models=models)


def _timeout(deadline_unix_s: float) -> float | None:
    if deadline_unix_s <= 0:
        return None
    return max(0.001, deadline_unix_s - time.time())
