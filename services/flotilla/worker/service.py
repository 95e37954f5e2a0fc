"""WorkerService handlers: Generate streams coalesced TokenChunks then Finished; errors are events. A request
that names a prefill worker is prefilled there first when this worker has the KV hand-off (decode_side.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.worker.v1 import worker_pb2 as wpb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.outputs import RequestOutput
from flotilla.rpc.convert import (
    chunk_response,
    error_response,
    fill_chunk,
    finished_response,
    invalid_request_response,
    load_report,
    new_request_from_proto,
)
from flotilla.rpc.leases import LeaseVerifier
from flotilla.rpc.session_server import serve_session
from flotilla.rpc.tls import peer_identity
from flotilla.worker.telemetry import RequestTelemetry, WorkerMetrics

if TYPE_CHECKING:
    from flotilla.worker.decode_side import DecodeSide
    from flotilla.worker.output_check import OutputCheck

logger = logging.getLogger(__name__)


def model_info(engine: AsyncEngine, name: str, assets_digest: str) -> pb.ModelInfo:
    """`assets_digest`: of the checkpoint's tokenizer files (engine/tokenizer_files.py), which the router
    hands to gateways."""
    llm = engine.engine
    return pb.ModelInfo(
        name=name,
        version=llm.model_version,
        max_model_len=llm.max_model_len,
        assets_digest=assets_digest,
    )


class WorkerService(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine: AsyncEngine, worker_id: str, model: pb.ModelInfo,
                 metrics: WorkerMetrics | None = None):
        self._engine = engine
        self.worker_id = worker_id
        self.model = model
        self.metrics = metrics or WorkerMetrics()
        # The KV hand-off's decode side (kv_wiring.py, roles prefill and decode): a request that names a
        # prefill worker is prefilled there. None: every request is prefilled here.
        self.decode_side: DecodeSide | None = None
        self.output_check: OutputCheck | None = None  # when on: its failure makes Health not ready
        # Placement leases (rpc/leases.py): with a verifier every stream needs a valid lease for this worker;
        # without one only the router (its relay) may open streams.
        self.leases: LeaseVerifier | None = None

    async def GenerateSession(self, actions, context: grpc.aio.ServicerContext) -> None:
        """Many Generate streams on one call; the way in of the gateways and the router (rpc/session_server.py)."""
        caller_role = caller_role_of(context)
        await serve_session(actions, context, lambda request, sink: self._generate(request, sink, caller_role))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        await self._generate(request, context, caller_role_of(context))

    async def generate_as(self, request: pb.GenerateRequest, context, caller_role: str | None) -> None:
        """Generate for a caller whose role is known already: a session's stream (its sink has no auth context;
        the role is the session's)."""
        await self._generate(request, context, caller_role)

    def _lease_refusal(self, request: pb.GenerateRequest, caller_role: str | None) -> str | None:
        if self.leases is not None:
            return self.leases.refusal(request)
        if caller_role is not None and caller_role != "router":
            return "this worker checks no leases (no --lease-secret-file): only its router may open streams"
        return None

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        caller_role: str | None) -> None:
        """Colocated and disaggregated requests alike: open the stream (_open), then relay its outputs.
        `caller_role`: the certificate role of who opened it (None: plaintext)."""
        refusal = self._lease_refusal(request, caller_role)
        if refusal is not None:
            logger.warning("refused request %s: %s", request.request_id, refusal)
            await context.write(error_response(pb.ERROR_CODE_LEASE_REFUSED, refusal, "lease", self.worker_id))
            return
        if not self._serves(request.model):
            message = f"this worker serves {self.model.name}@{self.model.version}, not {request.model}"
            await context.write(error_response(pb.ERROR_CODE_MODEL_NOT_FOUND, message, "model", self.worker_id))
            return
        # One worker.generate span and request count per call; a KV hand-off is a child span of it.
        telemetry = self.telemetry(request.request_id, context)
        try:
            stream = await self._open(request, telemetry)
        except InvalidRequestError as exc:
            telemetry.finish("invalid_request")
            await context.write(invalid_request_response(exc, self.worker_id))
            return
        except EngineDeadError as exc:
            telemetry.finish("unavailable")
            await context.write(error_response(pb.ERROR_CODE_UNAVAILABLE, str(exc), worker_id=self.worker_id))
            return
        except BaseException:
            telemetry.finish("cancelled")
            raise
        # A cancelled RPC (the caller went away, or its deadline passed) raises CancelledError at an await
        # below; closing the stream then aborts the request in the engine.
        outcome = "cancelled"  # unless the stream ends or fails below
        outgoing_response = getattr(context, "outgoing_response", None)  # a session's stream (rpc/session_server.py)
        if outgoing_response is not None:
            worker_id = self.worker_id

            def relay_tokens(output: RequestOutput) -> bool:
                """Token chunks leave as the engine delivers them, without waking this task per token."""
                telemetry.on_output(output)
                if output.new_token_ids or output.text_delta:
                    fill_chunk(outgoing_response(), output, worker_id)
                return True

            stream.deliver_directly(relay_tokens)
        try:
            async for output in stream:
                telemetry.on_output(output)
                if output.finished:  # before the write: the caller may hang up as soon as it has the result
                    outcome = output.finish_reason.value if output.finish_reason else "stop"
                await self._write(context, output)
        except EngineDeadError as exc:
            outcome = "engine_dead"
            await context.write(error_response(pb.ERROR_CODE_INTERNAL, str(exc), worker_id=self.worker_id))
        finally:
            stream.close()
            telemetry.finish(outcome)

    async def _open(self, request: pb.GenerateRequest, telemetry: RequestTelemetry) -> RequestStream:
        """The request's stream: prefilled on the prefill worker it names when this worker can receive KV
        (DecodeSide; it may decline, then the prompt is prefilled here), else prefilled here. Raises
        InvalidRequestError and EngineDeadError; a cancelled call holds nothing afterwards."""
        if request.prefill_worker_address and self.decode_side is not None:
            stream = await self.decode_side.open_stream(request, request.prefill_worker_address, telemetry)
            if stream is not None:
                return stream
        return await self._engine.generate(new_request_from_proto(request))  # a resumed stream's too

    def telemetry(self, request_id: str, context: grpc.aio.ServicerContext) -> RequestTelemetry:
        return RequestTelemetry(self.metrics, self.model.name, self.worker_id, request_id,
                                context.invocation_metadata())

    def _serves(self, requested: str) -> bool:
        """The router sends name@version; a mismatch means this address now holds other weights."""
        name, sep, version = requested.partition("@")
        return not sep or (name == self.model.name and version == self.model.version)

    async def _write(self, context: grpc.aio.ServicerContext, output: RequestOutput) -> None:
        chunk = chunk_response(output, self.worker_id)
        if chunk is not None:
            await context.write(chunk)
        if output.finished:
            await context.write(finished_response(output, self.worker_id))

    async def Abort(self, request: wpb.AbortRequest, context: grpc.aio.ServicerContext) -> wpb.AbortResponse:
        try:
            found = await self._engine.abort(request.request_id)
        except EngineDeadError:
            found = False
        return wpb.AbortResponse(found=found)

    async def Health(self, request: wpb.HealthRequest, context: grpc.aio.ServicerContext) -> wpb.HealthResponse:
        problem = self.output_check.failure if self.output_check is not None else ""
        return wpb.HealthResponse(ready=self._engine.is_running and not problem, worker_id=self.worker_id,
                                  model=self.model, problem=problem)

    async def GetLoad(self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        load = current_load(self._engine)
        if self.output_check is not None:
            load.output_check_failure = self.output_check.failure
        identity = peer_identity(context)
        if identity is not None and identity.role != "router":
            load.ClearField("active_request_ids")  # which requests run here: the router's business only
        return load


def caller_role_of(context: grpc.aio.ServicerContext) -> str | None:
    identity = peer_identity(context)
    return identity.role if identity is not None else None


def current_load(engine: AsyncEngine) -> pb.LoadReport:
    snapshot = engine.snapshot()
    return load_report(snapshot.stats, snapshot.active_request_ids)
