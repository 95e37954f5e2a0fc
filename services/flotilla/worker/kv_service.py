"""KVTransferService handlers: thin wiring over DecodeSide, PrefillSide and the block accounting."""

from __future__ import annotations

import logging

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2_grpc
from flotilla.engine.async_engine import EngineDeadError
from flotilla.engine.engine import LLMEngine
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.kv_cache_manager import KVCacheIntegrityError
from flotilla.rpc.convert import chunk_response, error_response, finished_response, invalid_request_response
from flotilla.worker.decode_side import DecodeSide
from flotilla.worker.kv_handoff import KVHandoff
from flotilla.worker.prefill_side import PrefillSide
from flotilla.worker.service import WorkerService

logger = logging.getLogger(__name__)


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    def __init__(self, handoff: KVHandoff, worker: WorkerService, self_address: str):
        self._handoff = handoff
        self._worker = worker
        self._decode = DecodeSide(handoff, self_address, worker.metrics.kv_transfer, worker.model.name)
        self._prefill = PrefillSide(handoff, worker.metrics.kv_transfer, worker.model.name)

    async def GenerateDisaggregated(
        self, request: kpb.DisaggregatedGenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        gen = request.request
        if not self._worker._serves(gen.model):
            await self._worker.Generate(gen, context)  # answers MODEL_NOT_FOUND
            return
        worker_id = self._worker.worker_id
        # One worker.generate span and request count per call, the KV hand-off (if any) a child span of it.
        telemetry = self._worker.telemetry(gen.request_id, context)
        try:
            stream = await self._decode.open_stream(gen, request.prefill_worker_address, telemetry)
        except InvalidRequestError as exc:
            telemetry.finish("invalid_request")
            await context.write(invalid_request_response(exc, worker_id))
            return
        except EngineDeadError as exc:
            telemetry.finish("unavailable")
            await context.write(error_response(pb.ERROR_CODE_UNAVAILABLE, str(exc), worker_id=worker_id))
            return
        except BaseException:
            telemetry.finish("cancelled")
            raise
        if stream is None:  # prefill here
            await self._worker.Generate(gen, context, telemetry)
            return
        outcome = "cancelled"  # unless the stream ends or fails below
        try:
            async for output in stream:
                telemetry.on_output(output)
                chunk = chunk_response(output, worker_id)
                if chunk is not None:
                    await context.write(chunk)
                if output.finished:
                    outcome = output.finish_reason.value if output.finish_reason else "stop"
                    await context.write(finished_response(output, worker_id))
        except EngineDeadError as exc:
            outcome = "engine_dead"
            await context.write(error_response(pb.ERROR_CODE_INTERNAL, str(exc), worker_id=worker_id))
        finally:
            stream.close()
            telemetry.finish(outcome)

    async def GetTransferInfo(self, request, context) -> kpb.TransferInfo:
        return self._handoff.transfer_info()

    async def RemotePrefill(self, request: kpb.RemotePrefillRequest, context) -> kpb.RemotePrefillResponse:
        return await self._prefill.remote_prefill(request, context)

    async def AbortRemotePrefill(self, request, context) -> kpb.AbortRemotePrefillResponse:
        return await self._prefill.abort(request)

    async def GetKVState(self, request, context) -> kpb.KVState:
        handoff = self._handoff
        reserved = [r.request.request_id for r in handoff.incoming.values()]
        state: kpb.KVState = await handoff.engine.call(lambda llm: kv_state(llm, reserved))
        counters = handoff.counters
        state.num_incoming_transfers = len(handoff.incoming)
        state.num_outgoing_transfers = len(handoff.outgoing)
        state.num_transfers_completed = counters.num_completed
        state.num_transfers_failed = counters.num_failed
        state.num_bytes_sent = counters.num_bytes_sent
        state.num_local_fallbacks = counters.num_local_fallbacks
        return state


def kv_state(engine: LLMEngine, reserved_request_ids: list[str]) -> kpb.KVState:
    """Engine thread: the block accounting, with the full invariant check."""
    kv = engine.kv_cache_manager
    state = kpb.KVState(
        num_free_blocks=kv.num_free_blocks,
        num_total_blocks=kv.num_blocks,
        num_reserved_blocks=sum(len(kv.block_ids(request_id)) for request_id in reserved_request_ids),
        num_running=engine.scheduler.num_running,
        num_waiting=engine.scheduler.num_waiting,
    )
    try:
        state.integrity_ok = kv.check_integrity()
    except KVCacheIntegrityError as exc:
        state.integrity_error = str(exc)
    return state
