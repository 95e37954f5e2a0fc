"""Decode worker side of a hand-off, for WorkerService.Generate when a request names its prefill worker:
reserve the blocks, have the prefill worker fill them layer by layer, and admit the request into the running
batch once every write has arrived; Generate then streams its tokens like any other request's. A resumed
stream (num_previous_output_tokens) is prefilled remotely too: both sides continue its seeds at that index.

Lifetimes: on any failure the reserved blocks are freed at once only when the prefill worker said that no
write into them can land any more (writes_settled, in its RemotePrefill answer or its AbortRemotePrefill
answer, which comes once its engine dropped the request, between steps). Otherwise (no answer: the peer died,
is unreachable, or the abort failed; or a write of it timed out but may still be carried out) the blocks are
quarantined: held, never handed to another request, until the transfer's lease ended (the reservation + the
lease, after which the prefill worker posts nothing for it) plus a grace for a write posted just before, then
freed. If the prefill worker fails or the transfer misses its lease, the request is prefilled here instead
(placed again, on this worker, in fresh blocks); a cancelled call frees everything and ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2_grpc
from flotilla.engine.async_engine import EngineDeadError, Prefilled, RequestStream
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.remote_prefill import KVReservation, quarantine, release, try_reserve
from flotilla.engine.scheduler_output import TokenLogprobs
from flotilla.observability.kv_transfer import KVTransferMetrics
from flotilla.rpc.convert import new_request_from_proto
from flotilla.worker.kv_handoff import KVHandoff

if TYPE_CHECKING:
    from flotilla.worker.telemetry import RequestTelemetry

logger = logging.getLogger(__name__)

ABORT_CALL_TIMEOUT_S = 5.0
QUARANTINE_GRACE_S = 5.0  # after the lease: for a write the prefill worker posted just before it ended


class HandoffFailed(Exception):
    """The remote prefill did not deliver; prefill locally."""


@dataclass
class _Lease:
    deadline: float  # time.monotonic(): the prefill worker posts no write for the transfer after it
    settled: bool = False  # the prefill worker said that no write of the transfer can land any more


class DecodeSide:
    def __init__(self, handoff: KVHandoff, self_address: str, metrics: KVTransferMetrics | None = None,
                 model: str = "", quarantine_grace_s: float = QUARANTINE_GRACE_S):
        self._handoff = handoff
        self._quarantine_grace_s = quarantine_grace_s
        self._self_address = self_address
        self._metrics = metrics
        self._model = model

    async def open_stream(self, gen: pb.GenerateRequest, prefill_address: str,
                          telemetry: RequestTelemetry | None = None) -> RequestStream | None:
        """The request's stream after a remote prefill, or None when it should be prefilled locally.
        Raises InvalidRequestError (before anything is held) and EngineDeadError."""
        if not prefill_address:
            return None
        handoff = self._handoff
        new = new_request_from_proto(gen)  # a resumed stream's too
        min_tokens = handoff.settings.min_remote_prefill_tokens
        reservation = await self._reserve(new, min_tokens)
        if reservation is None:
            return None
        # Unguessable: it is the only proof a peer has of taking part in this hand-off (GetTransferInfo,
        # write notifications, AbortRemotePrefill), and names only this request's reserved blocks.
        transfer_id = secrets.token_urlsafe(24)
        handoff.incoming[transfer_id] = reservation
        lease = _Lease(time.monotonic() + handoff.settings.lease_s)
        span = telemetry.kv_transfer_span() if telemetry is not None else trace.INVALID_SPAN
        span.set_attribute("flotilla.kv_transfer.prefill_worker", prefill_address)
        try:
            prefilled = await self._fill(gen, transfer_id, reservation, prefill_address, span, lease)
        except HandoffFailed as exc:
            logger.warning("remote prefill of %s failed (%s); prefilling here", gen.request_id, exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"local fallback: {exc}"))
            handoff.counters.num_local_fallbacks += 1
            await self._release(transfer_id, reservation, lease)
            return None
        except BaseException:  # cancelled by the caller, or the engine died
            span.set_status(trace.Status(trace.StatusCode.ERROR, "cancelled"))
            await self._release(transfer_id, reservation, lease)
            raise
        finally:
            span.end()
        handoff.incoming.pop(transfer_id, None)
        handoff.arrivals.forget(transfer_id)
        try:
            return await handoff.engine.generate_prefilled(prefilled)
        except InvalidRequestError:  # refused before the engine took it over (its id is in use here)
            await self._release(transfer_id, reservation, _Lease(0.0, settled=True))  # every write arrived
            raise

    async def _reserve(self, new: NewRequest, min_tokens: int) -> KVReservation | None:
        """try_reserve on the engine thread. Cancel-safe: the reservation is made there even if this
        coroutine is cancelled while waiting, so a cancelled wait releases it once it lands."""
        engine = self._handoff.engine
        reserving = asyncio.ensure_future(engine.call(lambda llm: try_reserve(llm, new, min_tokens)))
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:
            reserving.add_done_callback(self._release_late)
            raise

    def _release_late(self, reserving: asyncio.Future[KVReservation | None]) -> None:
        if reserving.cancelled() or reserving.exception() is not None or reserving.result() is None:
            return
        asyncio.ensure_future(self._free(reserving.result()))

    async def _free(self, reservation: KVReservation) -> None:
        try:
            await self._handoff.engine.call(lambda llm: release(llm, reservation))
        except EngineDeadError:
            pass

    async def _fill(
        self, gen: pb.GenerateRequest, transfer_id: str, reservation: KVReservation, prefill_address: str,
        span: trace.Span, lease: _Lease,
    ) -> Prefilled:
        handoff = self._handoff
        started = time.perf_counter()
        lease_s = handoff.settings.lease_s
        deadline = lease.deadline
        stub = handoff.peer_stub(prefill_address)
        handoff.arrivals.open(transfer_id, reservation.dst_block_ids)  # before the peer learns the id
        request = kpb.RemotePrefillRequest(
            request=gen, transfer_id=transfer_id, decode_worker_address=self._self_address,
            decode_agent_name=handoff.transport.name, dst_block_ids=reservation.dst_block_ids,
            first_block_index=reservation.first_block_index, lease_s=lease_s,
        )  # fmt: skip
        try:
            response = await _guarded(stub.RemotePrefill(request, timeout=lease_s), stub, transfer_id, lease)
        except grpc.aio.AioRpcError as exc:
            raise HandoffFailed(f"prefill worker: {exc.code().name}") from None
        lease.settled = response.writes_settled
        if response.HasField("error"):
            raise HandoffFailed(response.error.message)
        try:
            arrived = handoff.arrivals.expect(transfer_id, response.num_writes)
            await asyncio.wait_for(arrived, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise HandoffFailed(f"{response.num_writes} writes did not all arrive within the lease") from None
        problem = handoff.arrivals.check(transfer_id, response.prefill_agent_name)
        if problem is not None:  # it wrote, or says it wrote, outside the blocks reserved for it
            logger.error("refused the KV hand-off of %s from %s: %s", gen.request_id, prefill_address, problem)
            handoff.counters.num_refused_handoffs += 1
            lease.settled = False  # its word is worth nothing now: wait out the lease
            raise HandoffFailed(f"a write notification failed its checks: {problem}")
        # Every layer's blocks are here: the hand-off is complete on this side.
        span.set_attribute("flotilla.kv_transfer.bytes", response.num_bytes)
        span.set_attribute("flotilla.kv_transfer.writes", response.num_writes)
        if self._metrics is not None:
            self._metrics.observe(self._model, "receive", response.num_bytes, time.perf_counter() - started)
        logprobs = None
        if response.HasField("first_logprob"):
            lp = response.first_logprob
            logprobs = TokenLogprobs(lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs)))
        return Prefilled(reservation.request, response.first_token_id, logprobs)

    async def _release(self, transfer_id: str, reservation: KVReservation, lease: _Lease) -> None:
        """Free the reservation, or quarantine it until the lease ended when a write may still land."""
        handoff = self._handoff
        handoff.incoming.pop(transfer_id, None)
        handoff.arrivals.forget(transfer_id)  # late notifications of it are dropped
        if lease.settled:
            fn = lambda llm: release(llm, reservation)  # noqa: E731
        else:
            until = lease.deadline + self._quarantine_grace_s
            fn = lambda llm: quarantine(llm, reservation, transfer_id, until)  # noqa: E731
            logger.info("quarantined the blocks of hand-off %s for %.1f s", reservation.request.request_id,
                        until - time.monotonic())  # fmt: skip
        try:
            await asyncio.shield(handoff.engine.call(fn))
        except EngineDeadError:
            pass


async def _guarded(
    call: Awaitable[kpb.RemotePrefillResponse], stub: kv_transfer_pb2_grpc.KVTransferServiceStub, transfer_id: str,
    lease: _Lease,
) -> kpb.RemotePrefillResponse:
    """Await the prefill; if that is cancelled or fails, stop the prefill worker's writes before returning;
    its answer says whether the reserved blocks can be freed at once (lease.settled)."""
    try:
        return await call
    except BaseException as exc:
        if not _peer_is_gone(exc):
            lease.settled = await asyncio.shield(_abort_remote(stub, transfer_id))
        raise


def _peer_is_gone(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


async def _abort_remote(stub: kv_transfer_pb2_grpc.KVTransferServiceStub, transfer_id: str) -> bool:
    """True when the prefill worker stopped the hand-off and none of its writes can land any more."""
    try:
        response = await stub.AbortRemotePrefill(kpb.AbortRemotePrefillRequest(transfer_id=transfer_id),
                                                 timeout=ABORT_CALL_TIMEOUT_S)  # fmt: skip
    except grpc.aio.AioRpcError as exc:
        logger.warning("AbortRemotePrefill %s failed: %s", transfer_id, exc.code().name)
        return False
    return response.writes_settled
