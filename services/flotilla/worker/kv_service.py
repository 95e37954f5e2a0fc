"""KVTransferService handlers: thin wiring over PrefillSide and the block accounting. The decode side of a
hand-off runs inside WorkerService.Generate (decode_side.py)."""

from __future__ import annotations

import logging

import grpc

from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2_grpc
from flotilla.engine.engine import LLMEngine
from flotilla.engine.kv_cache_manager import KVCacheIntegrityError
from flotilla.worker.kv_handoff import KVHandoff
from flotilla.rpc.tls import peer_identity
from flotilla.worker.prefill_side import PrefillSide
from flotilla.worker.service import WorkerService

logger = logging.getLogger(__name__)


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    def __init__(self, handoff: KVHandoff, worker: WorkerService):
        self._handoff = handoff
        self._prefill = PrefillSide(handoff, worker.metrics.kv_transfer, worker.model.name)

    async def GetTransferInfo(self, request: kpb.GetTransferInfoRequest, context) -> kpb.TransferInfo:
        # The pool's NIXL metadata lets a peer write into it: only for a hand-off this worker started.
        if not request.transfer_id or request.transfer_id not in self._handoff.incoming:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no hand-off in flight with that transfer id")
        return self._handoff.transfer_info()

    async def RemotePrefill(self, request: kpb.RemotePrefillRequest, context) -> kpb.RemotePrefillResponse:
        return await self._prefill.remote_prefill(request, context, _caller(context))

    async def AbortRemotePrefill(self, request, context) -> kpb.AbortRemotePrefillResponse:
        return await self._prefill.abort(request, _caller(context))

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
        state.num_refused_notifications = handoff.arrivals.num_refused
        state.num_refused_handoffs = counters.num_refused_handoffs
        return state


def _caller(context: grpc.aio.ServicerContext) -> str:
    identity = peer_identity(context)
    return str(identity) if identity is not None else ""


def kv_state(engine: LLMEngine, reserved_request_ids: list[str]) -> kpb.KVState:
    """Engine thread: the block accounting, with the full invariant check."""
    kv = engine.kv_cache_manager
    state = kpb.KVState(
        num_free_blocks=kv.num_free_blocks,
        num_total_blocks=kv.num_blocks,
        num_reserved_blocks=sum(len(kv.block_ids(request_id)) for request_id in reserved_request_ids),
        num_quarantined_blocks=kv.num_quarantined_blocks,
        num_running=engine.scheduler.num_running,
        num_waiting=engine.scheduler.num_waiting,
    )
    try:
        state.integrity_ok = engine.check_integrity()  # its own reservation record: exact on this thread
    except KVCacheIntegrityError as exc:
        state.integrity_error = str(exc)
    return state
