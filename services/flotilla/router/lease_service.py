"""Placement leases (Acquire, AcquireSession): the router decides, the gateway streams from the worker.

An Acquire call carries the request as Generate would (prompt, class, tenant, deadline, wait budget, cache
salt; on a retry the workers to avoid). It goes through admission exactly as a relayed request does (one
queue per model and class, deficit round robin between tenants, deadline dropping, the 529 estimate, routes
and rollouts), then the disaggregation planner (prefix affinity within a load cap, a prefill worker). The
answer is one Lease event: the worker, its address, the resolved model version, the prefill worker, an expiry
and a token the worker checks (rpc/leases.py). Then the call stays open: the lease holds its slot on the
worker until the call ends: the gateway closes it with a StreamReport (the outcome, TTFT, TPOT and tokens
the router's stats and the autoscaler's signals need), or cancels it, or its session ends because the
gateway is gone. So a dead gateway's leases are released the moment its connection drops (keepalive finds a
silent one), with no renewal traffic and no sweeper. No token passes through the router.
"""

from __future__ import annotations

import asyncio

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.rpc.convert import error_response
from flotilla.rpc.leases import LeaseSigner
from flotilla.rpc.session_server import serve_session
from flotilla.router.admission import RouterError, Ticket
from flotilla.router.telemetry import RouterRequestTelemetry


class LeaseRpcs:
    """RouterService's lease methods (a mixin: it uses the service's admission, registry, planner, traffic
    and metrics)."""

    leases: LeaseSigner | None = None  # None: no lease secret, Acquire refused (gateways relay instead)

    async def AcquireSession(self, actions, context: grpc.aio.ServicerContext) -> None:
        """Many Acquire streams on one call: the gateway's way in (rpc/session_server.py)."""
        await serve_session(actions, context, self.Acquire)

    async def Acquire(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if self.leases is None:
            await context.write(error_response(pb.ERROR_CODE_UNAVAILABLE, "this router grants no leases (started "
                                               "without --lease-secret-file): stream through GenerateSession"))
            return
        if not request.request_id:
            await context.write(error_response(pb.ERROR_CODE_INVALID_REQUEST, "must not be empty", "request_id"))
            return
        telemetry = RouterRequestTelemetry(self.metrics, request, self._model_label(request.model),
                                           context.invocation_metadata(), span_name="router.acquire")
        try:
            await self._grant_and_hold(request, context, telemetry)
        finally:
            telemetry.finish()

    async def _grant_and_hold(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                              telemetry: RouterRequestTelemetry) -> None:
        avoid = frozenset(request.avoid_worker_ids)
        try:
            placement = await self._admission.acquire(request.model, len(request.prompt_token_ids),
                                                      request.deadline_unix_s, Ticket.of(request), avoid=avoid)
        except RouterError as exc:
            telemetry.failed(exc.code)
            await context.write(exc.as_response())
            return
        telemetry.placed(placement)
        name = placement.resolution.name
        try:
            plan = self._disagg.plan(placement.worker, request, avoid=avoid, long_context=placement.long_context)
            worker = plan.decode
            telemetry.running_on(worker.worker_id)
            worker.num_inflight += 1
            try:
                if not avoid:
                    self.traffic.record_prompt(name, len(request.prompt_token_ids))
                lease = self.leases.grant(request.request_id, worker.worker_id, worker.info.address,
                                          placement.resolution.qualified, plan.prefill_worker_address)
                await context.write(pb.GenerateResponse(lease=lease, worker_id=worker.worker_id))
                await asyncio.get_running_loop().create_future()  # held until the caller ends the stream
            finally:
                # Cancelled: released by the caller (with its report), or its session ended (the caller gone).
                report = getattr(context, "report", None)
                if report is not None:
                    self._account(name, report, telemetry)
                    if report.worker_unreachable:
                        self._registry.mark_failed(worker.worker_id)
                worker.num_inflight -= 1
                self._registry.release(worker, request.tenant_id, placement.long_context, name)
        finally:
            self._admission.dispatch()  # the released slot may take a queued request

    def _account(self, name: str, report: pb.StreamReport, telemetry: RouterRequestTelemetry) -> None:
        telemetry.on_report(report)
        self.traffic.record_output(name, report.num_output_tokens)
        if report.ttft_s > 0:
            self.traffic.record_ttft(name, report.ttft_s)
