"""RouterService handlers: worker membership, model listing, placement leases (lease_service.py) and the relay
of token streams (the path of gateways whose router grants no leases)."""

from __future__ import annotations

import logging
import time

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.engine.tokenizer_files import MAX_TOTAL_BYTES
from flotilla.rpc.convert import error_response, stream_event
from flotilla.rpc.batch_session import serve_batch_session
from flotilla.rpc.model_assets import MalformedAssetsError, asset_chunks, receive_assets
from flotilla.rpc.session_server import serve_session
from flotilla.rpc.tls import peer_identity
from flotilla.rpc.stream_events import Chunk, StreamEvent
from flotilla.router.admission import Admission, Placement, RouterError, Ticket
from flotilla.router.batch_dispatcher import BatchDispatcher
from flotilla.router.context_pools import POOLS
from flotilla.router.disagg_planner import DisaggPlanner
from flotilla.router.model_assets import RejectedAssetsError
from flotilla.rpc.failover import DEFAULT_MAX_ATTEMPTS, StreamProgress, WorkerLost
from flotilla.rpc.leases import LeaseSigner
from flotilla.router.lease_service import LeaseRpcs
from flotilla.router.lifecycle_service import ModelLifecycleRpcs
from flotilla.router.models import aliases_of
from flotilla.router.pool_signals import pool_signals
from flotilla.router.queue_load import queue_load
from flotilla.router.registry import WorkerRegistry
from flotilla.router.traffic import TrafficWindow
from flotilla.router.telemetry import RouterMetrics, RouterRequestTelemetry

logger = logging.getLogger(__name__)

# Worker call failures that mean the worker itself is gone, not that this one request went wrong.
_WORKER_GONE = (grpc.StatusCode.UNAVAILABLE,)


class RouterService(LeaseRpcs, ModelLifecycleRpcs, router_pb2_grpc.RouterServiceServicer):
    max_attempts = DEFAULT_MAX_ATTEMPTS  # workers one request may be placed on (failover.py)

    def __init__(
        self,
        registry: WorkerRegistry,
        admission: Admission,
        heartbeat_interval_s: float,
        metrics: RouterMetrics | None = None,
        batches: BatchDispatcher | None = None,
        leases: LeaseSigner | None = None,
    ):
        self._registry = registry
        self._admission = admission
        self._heartbeat_interval_ms = int(heartbeat_interval_s * 1000)
        self.traffic = TrafficWindow()  # TTFT and token mix for GetPoolSignals (autoscaler)
        self.metrics = metrics or RouterMetrics()
        self._disagg = DisaggPlanner(registry, getattr(admission, "_limits", None))
        self.batches = batches  # fixed-batch models (batch_dispatcher.py); None: BatchGenerateSession refused
        self.leases = leases  # signs placement leases (lease_service.py); workers with the secret require one
        self._init_lifecycle()

    # ---- fixed-batch models ------------------------------------------------------------------------
    async def BatchGenerateSession(self, calls, context: grpc.aio.ServicerContext) -> None:
        """Calls of fixed-batch models, batched onto their workers' RunBatch (rpc/batch_session.py)."""
        if self.batches is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router has no batch dispatcher")
        batches = self.batches
        await serve_batch_session(calls, context, batches.submit,
                                  lambda pending, call: batches.cancel(pending, call.model))

    def _membership_changed(self) -> None:
        self._admission.dispatch()
        if self.batches is not None:
            self.batches.wake()

    # ---- generation --------------------------------------------------------------------------------
    async def GenerateSession(self, actions, context: grpc.aio.ServicerContext) -> None:
        """Many Generate streams on one call; the gateway's way in (rpc/session_server.py)."""
        await serve_session(actions, context, self.Generate)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if not request.request_id:
            await context.write(error_response(pb.ERROR_CODE_INVALID_REQUEST, "must not be empty", "request_id"))
            return
        telemetry = RouterRequestTelemetry(self.metrics, request, self._model_label(request.model),
                                           context.invocation_metadata())
        try:
            await self._place_and_relay(request, context, telemetry)
        finally:
            telemetry.finish()

    async def _place_and_relay(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, telemetry: RouterRequestTelemetry
    ) -> None:
        arrived_s = time.monotonic()
        try:
            placement = await self._admission.acquire(
                request.model, len(request.prompt_token_ids), request.deadline_unix_s, Ticket.of(request)
            )
        except RouterError as exc:
            telemetry.failed(exc.code)
            await context.write(exc.as_response())
            return
        telemetry.placed(placement)
        try:
            self.traffic.record_prompt(placement.resolution.name, len(request.prompt_token_ids))
            await self._relay_with_failover(request, placement, context, telemetry, arrived_s)
        finally:
            self._admission.dispatch()  # a finished request may have made room for a queued one

    async def _relay_with_failover(self, request: pb.GenerateRequest, placement: Placement,
                                   context: grpc.aio.ServicerContext, telemetry: RouterRequestTelemetry,
                                   arrived_s: float | None) -> None:
        """Relay attempts until one ends the stream; a lost worker's request goes on elsewhere (failover.py)."""
        progress = StreamProgress(request, self.max_attempts)
        while placement is not None:
            try:
                await self._relay(request, placement, context, telemetry, arrived_s=arrived_s, progress=progress)
                return
            except WorkerLost as lost:
                loss = lost
            arrived_s = arrived_s if not progress.num_delivered else None
            placement = await self._after_loss(progress, placement, loss, context)

    async def _after_loss(self, progress: StreamProgress, placement: Placement, lost: WorkerLost,
                          context: grpc.aio.ServicerContext) -> Placement | None:
        """Place the request again (same model version); None when the caller got its last event instead."""
        if lost.unreachable:
            self._registry.mark_failed(lost.worker_id)
        progress.lost.append(lost)
        logger.warning("request %s lost %s after %d tokens (attempt %d of %d)", progress.request.request_id, lost,
                       progress.num_delivered, progress.num_attempts, progress.max_attempts)
        if progress.is_complete:
            await context.write(progress.finished_response())
            return None
        if not progress.can_retry:
            await context.write(progress.exhausted_response())
            return None
        request = progress.request
        try:
            return await self._admission.acquire(placement.resolution.qualified,
                                                 len(request.prompt_token_ids) + progress.num_delivered,
                                                 request.deadline_unix_s, Ticket.of(request),
                                                 avoid=progress.lost_worker_ids)
        except RouterError as exc:
            # Its version may be gone with its last worker: still "retry later" for the caller, not a 404.
            code = pb.ERROR_CODE_UNAVAILABLE if exc.code == pb.ERROR_CODE_MODEL_NOT_FOUND else exc.code
            refusal = error_response(code, f"worker lost ({lost.reason}) and none took the request over: "
                                           f"{exc.message}; retry")
            refusal.error.retry_after_s = exc.retry_after_s or 1.0
            await context.write(progress.stamp(refusal))
            return None

    def _model_label(self, requested: str) -> str:
        """The resolved model name for metrics (aliases fold into their model), else what was asked for."""
        try:
            return self._admission.resolve(requested).name
        except RouterError:
            return requested

    async def _relay(
        self,
        request: pb.GenerateRequest,
        placement: Placement,
        context: grpc.aio.ServicerContext,
        telemetry: RouterRequestTelemetry,
        arrived_s: float | None = None,
        progress: StreamProgress | None = None,
    ) -> None:
        progress = progress or StreamProgress(request)
        forwarded = progress.next_request(placement.resolution.qualified)
        # Decode worker by prefix affinity, then a prefill worker; a retry (a resumed stream too) is planned
        # the same way, away from the workers it was lost on.
        plan = self._disagg.plan(placement.worker, forwarded, avoid=progress.lost_worker_ids,
                                 long_context=placement.long_context)
        forwarded.prefill_worker_address = plan.prefill_worker_address
        worker = plan.decode
        if self.leases is not None:  # the worker checks it as it checks a gateway's
            forwarded.lease.CopyFrom(self.leases.grant(request.request_id, worker.worker_id, worker.info.address,
                                                       forwarded.model, plan.prefill_worker_address))
        telemetry.running_on(worker.worker_id)
        worker.num_inflight += 1
        # One stream of the decode worker's session, colocated or not.
        call = worker.session.generate(forwarded, metadata=telemetry.outgoing_metadata(),
                                       timeout=_timeout(request.deadline_unix_s))  # fmt: skip

        def account(response: pb.GenerateResponse, event: StreamEvent) -> pb.GenerateResponse:
            """Progress, outcome and token counts of one relayed message, from its event (decoded once); raises
            WorkerLost. The message itself is relayed."""
            nonlocal arrived_s
            if type(event) is Chunk:
                progress.on_chunk(event)
                if event.token_ids:
                    arrived_s = self._record_tokens(placement, len(event.token_ids), arrived_s)
                    telemetry.on_tokens(len(event.token_ids))
            else:
                progress.on_result(event, response, worker.worker_id)
                telemetry.on_result(event)
            return response

        deliver_directly = getattr(call, "deliver_directly", None)  # a worker session's stream
        write_nowait = getattr(context, "write_nowait", None)  # our caller's session
        if deliver_directly is not None and write_nowait is not None:

            def relay_chunk(response: pb.GenerateResponse) -> bool:
                """Token chunks (never WorkerLost) are relayed as they arrive, without waking this task."""
                event = stream_event(response)
                if type(event) is not Chunk:
                    return False  # the last event goes through the relay task
                write_nowait(account(response, event))
                return True

            deliver_directly(relay_chunk)
        try:
            async for response in call:
                await context.write(account(response, stream_event(response)))
            if not progress.has_result:
                raise progress.ended_without_result(worker.worker_id)
        except grpc.aio.AioRpcError as exc:
            progress.on_call_error(exc, worker.worker_id)  # raises WorkerLost
            error = progress.stamp(self._worker_error(worker.worker_id, exc))
            telemetry.on_result(stream_event(error))
            await context.write(error)
        finally:
            if deliver_directly is not None:
                deliver_directly(None)
            # No-op when the stream ended; when our caller went away this cancels the worker call, which
            # aborts the request in its engine.
            call.cancel()
            worker.num_inflight -= 1
            # Its slot is free for the next queued request.
            self._registry.release(worker, request.tenant_id, placement.long_context, placement.resolution.name)

    def _record_tokens(self, placement: Placement, num_tokens: int, arrived_s: float | None) -> float | None:
        """Count relayed tokens for the token mix; the first ones also give a TTFT sample. Returns None
        (the request's arrival time is no longer needed once its first token is out)."""
        name = placement.resolution.name
        self.traffic.record_output(name, num_tokens)
        if arrived_s is not None:
            self.traffic.record_ttft(name, time.monotonic() - arrived_s)
        return None

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
        models = list(info.shared.models) if info.HasField("shared") else [info.model]
        if not info.worker_id or not info.address or not models or not all(m.name and m.version for m in models):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id, address and model name/version needed")
        if info.pool and info.pool not in POOLS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pool {info.pool!r}; known: {POOLS}")
        owner = await self._owning_caller(info.worker_id, context)
        self._registry.register(info, owner)
        self._membership_changed()
        digest = info.model.assets_digest
        missing = sorted({m.assets_digest for m in info.shared.models
                          if m.assets_digest and not self._registry.assets.has(m.assets_digest)})
        return rpb.RegisterWorkerResponse(heartbeat_interval_ms=self._heartbeat_interval_ms,
                                          send_model_assets=bool(digest) and not self._registry.assets.has(digest),
                                          send_assets_digests=missing)

    async def PublishModelAssets(self, request_iterator, context: grpc.aio.ServicerContext
                                 ) -> rpb.PublishModelAssetsResponse:
        try:
            digest, files = await receive_assets(request_iterator, MAX_TOTAL_BYTES)
            stored = self._registry.assets.put(digest, files, self._registry.announced_assets())
        except (MalformedAssetsError, RejectedAssetsError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return rpb.PublishModelAssetsResponse(stored=stored)

    async def GetModelAssets(self, request: rpb.GetModelAssetsRequest, context: grpc.aio.ServicerContext):
        files = self._registry.assets.get(request.digest)
        if files is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model assets {request.digest!r}")
        for chunk in asset_chunks(request.digest, files):
            yield chunk

    async def Heartbeat(
        self, request: rpb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> rpb.HeartbeatResponse:
        await self._owning_caller(request.worker_id, context)
        known = self._registry.heartbeat(request.worker_id, request.load)
        if known:
            self._membership_changed()
        return rpb.HeartbeatResponse(known=known)

    async def DeregisterWorker(
        self, request: rpb.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> rpb.DeregisterWorkerResponse:
        await self._owning_caller(request.worker_id, context)
        self._registry.deregister(request.worker_id)
        return rpb.DeregisterWorkerResponse()

    async def _owning_caller(self, worker_id: str, context: grpc.aio.ServicerContext) -> str:
        """The caller's identity, once it is sure to be the one bound to `worker_id` (or the id is free):
        another identity cannot take a registered worker's id over, nor speak for it."""
        identity = peer_identity(context)
        caller = str(identity) if identity is not None else ""
        owner = self._registry.owner_of(worker_id)
        if owner is not None and owner != caller:
            logger.warning("refused %s for worker id %s, which %s registered", caller or "a plaintext caller",
                           worker_id, owner or "a plaintext caller")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"worker id {worker_id} is registered by another identity")
        return caller

    async def ListWorkers(
        self, request: rpb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ListWorkersResponse:
        statuses = [self._registry.status(entry) for entry in self._registry.workers()]
        return rpb.ListWorkersResponse(workers=sorted(statuses, key=lambda s: s.worker.worker_id))

    async def SetWorkerState(
        self, request: rpb.SetWorkerStateRequest, context: grpc.aio.ServicerContext
    ) -> rpb.SetWorkerStateResponse:
        if not request.worker_id or request.state == rpb.WORKER_STATE_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and a state needed")
        registered, previous = self._registry.set_state(request.worker_id, request.state)
        self._membership_changed()  # a promoted worker takes queued requests at once
        return rpb.SetWorkerStateResponse(registered=registered, previous=previous)

    async def GetPoolSignals(
        self, request: rpb.GetPoolSignalsRequest, context: grpc.aio.ServicerContext
    ) -> rpb.GetPoolSignalsResponse:
        if not request.model or request.pool not in ("", *POOLS):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model needed; pool one of {POOLS} or empty")
        return pool_signals(request, self._registry, self.traffic, *self._admission.waiting(request.model,
                                                                                            request.pool))

    async def GetQueueLoad(
        self, request: rpb.GetQueueLoadRequest, context: grpc.aio.ServicerContext
    ) -> rpb.GetQueueLoadResponse:
        return queue_load(request, self._admission)

    async def ListModels(
        self, request: rpb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ListModelsResponse:
        versions = self._registry.model_versions()
        routes = self._admission.routes
        routes.observe(versions)
        models = []
        # A name's current version first (the gateway takes the first listed for a bare name), then the newest.
        current = {name: route.current for name, route in routes.routes.items()}
        for ref in sorted(versions, key=lambda r: (r.name, current.get(r.name) != r.version, -r.first_registered)):
            info = pb.ModelInfo()
            info.CopyFrom(self._registry.model_info(ref.name, ref.version))
            if not self._registry.assets.has(info.assets_digest):
                continue  # a gateway could not tokenize for it yet: listed once its worker sent the files
            info.aliases[:] = aliases_of(ref, versions, routes.aliases, routes.routes)
            models.append(info)
        return rpb.ListModelsResponse(models=models, grants_leases=self.leases is not None)


def _timeout(deadline_unix_s: float) -> float | None:
    if deadline_unix_s <= 0:
        return None
    return max(0.001, deadline_unix_s - time.time())
