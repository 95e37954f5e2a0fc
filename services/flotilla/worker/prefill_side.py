"""Prefill worker side of a hand-off: prefill the prompt (sampling only the first token) while the KV hook
writes each layer's blocks into the decode worker's reserved blocks.

Source blocks stay held until every write of a step has completed (the hook waits at the end of each step,
at most the lease); a write that fails (the decode worker died: a disconnect error) or does not complete
within the lease marks the hand-off failed, the request is aborted here, and its blocks are freed. A
cancelled call (the decode worker went away) aborts it too. No write is posted after the lease
(RemoteTarget.deadline). Every answer, RemotePrefill's and AbortRemotePrefill's, says whether a write of the
hand-off may still land (writes_settled: a write whose wait timed out may); the decode worker quarantines
the reserved blocks until the lease ended when it may, or when it got no answer.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.engine.async_engine import EngineDeadError
from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.outputs import RequestOutput
from flotilla.engine.remote_prefill import RemoteTarget
from flotilla.observability.kv_transfer import KVTransferMetrics
from flotilla.rpc.convert import logprobs_to_proto, new_request_from_proto
from flotilla.worker.kv_handoff import KVHandoff, remember

logger = logging.getLogger(__name__)


class PrefillSide:
    def __init__(self, handoff: KVHandoff, metrics: KVTransferMetrics | None = None, model: str = ""):
        self._handoff = handoff
        self._metrics = metrics
        self._model = model

    async def remote_prefill(
        self, request: kpb.RemotePrefillRequest, context: grpc.aio.ServicerContext, caller: str = ""
    ) -> kpb.RemotePrefillResponse:
        """`caller`: the decode worker's identity; only it may abort this hand-off."""
        handoff, gen = self._handoff, request.request
        transfer_id = request.transfer_id
        refusal = _check_target(request, handoff.outgoing)
        if refusal:
            # Nothing written for this call; a hand-off already in flight under this id is another matter.
            return _failed(pb.ERROR_CODE_INVALID_REQUEST, *refusal, settled=transfer_id not in handoff.outgoing)
        handoff.outgoing[transfer_id] = caller  # before any await: a second call with this id is refused
        started = time.monotonic()
        try:
            await handoff.ensure_peer(request.decode_agent_name, request.decode_worker_address, transfer_id,
                                      request.lease_s or 30)  # fmt: skip
        except (grpc.aio.AioRpcError, ValueError, RuntimeError) as exc:
            handoff.outgoing.pop(transfer_id, None)
            return _failed(pb.ERROR_CODE_UNAVAILABLE, f"cannot reach decode worker: {exc}", settled=True)
        except BaseException:
            handoff.outgoing.pop(transfer_id, None)
            raise
        if transfer_id in handoff.aborted:  # its abort overtook it while it waited for the peer
            handoff.outgoing.pop(transfer_id, None)
            return _failed(pb.ERROR_CODE_UNAVAILABLE, "the hand-off was aborted", settled=True)
        target = RemoteTarget(transfer_id, request.decode_agent_name, list(request.dst_block_ids),
                              request.first_block_index, deadline=started + (request.lease_s or 30))  # fmt: skip
        # The engine request is keyed by the transfer id: a retried request id never collides here.
        handoff.sender.add_target(transfer_id, target)
        try:
            first = await self._run_prefill(transfer_id, gen)
        except InvalidRequestError as exc:
            return _failed(pb.ERROR_CODE_INVALID_REQUEST, exc.message, exc.field, target.writes_settled)
        except EngineDeadError as exc:
            return _failed(pb.ERROR_CODE_UNAVAILABLE, str(exc))
        finally:
            handoff.sender.pop_target(transfer_id)
            handoff.outgoing.pop(transfer_id, None)
            remember(handoff.finished, transfer_id, target)
        if target.error is not None or first is None or not first.new_token_ids:
            handoff.counters.num_failed += 1
            return _failed(pb.ERROR_CODE_UNAVAILABLE, f"KV hand-off failed: {target.error or 'prefill aborted'}",
                           settled=target.writes_settled)  # fmt: skip
        handoff.counters.num_completed += 1
        handoff.counters.num_bytes_sent += target.num_bytes
        if self._metrics is not None:  # seconds: the call until every write completed (prefill overlaps it)
            self._metrics.observe(self._model, "send", target.num_bytes, time.monotonic() - started)
        response = kpb.RemotePrefillResponse(
            first_token_id=first.new_token_ids[0], num_writes=target.num_writes, num_bytes=target.num_bytes,
            num_cached_prompt_tokens=first.num_cached_prompt_tokens, writes_settled=True,  # every write completed
        prefill_agent_name=handoff.transport.name,
        )  # fmt: skip
        if first.logprobs:
            response.first_logprob.CopyFrom(logprobs_to_proto(first.new_token_ids[:1], first.logprobs[:1])[0])
        return response

    async def _run_prefill(self, transfer_id: str, gen: pb.GenerateRequest) -> RequestOutput | None:
        new = new_request_from_proto(gen)  # a resumed stream keeps its delivered tokens: its seed index
        params = dataclasses.replace(new.sampling_params, max_tokens=1)
        stream = await self._handoff.engine.generate(
            dataclasses.replace(new, request_id=transfer_id, sampling_params=params))
        first = None
        try:
            async for output in stream:  # a cancelled call (decode worker gone) aborts it via close()
                first = first or (output if output.new_token_ids else None)
                if output.finished:
                    break
        finally:
            stream.close()
        return first

    async def abort(self, request: kpb.AbortRemotePrefillRequest, caller: str = "") -> kpb.AbortRemotePrefillResponse:
        """Answered once the engine dropped the request: between steps, so no write of it is in flight. Only
        the decode worker that asked for the hand-off may stop it."""
        handoff, transfer_id = self._handoff, request.transfer_id
        owner = handoff.outgoing.get(transfer_id)
        if owner is not None and owner != caller:
            logger.warning("refused AbortRemotePrefill of a hand-off of %s to %s", owner, caller)
            return kpb.AbortRemotePrefillResponse(found=False)
        remember(handoff.aborted, transfer_id)  # before any await: a RemotePrefill still on its way is refused
        target = handoff.sender.pop_target(transfer_id) or handoff.finished.get(transfer_id)
        try:
            found = await handoff.engine.abort(transfer_id)
        except EngineDeadError:
            return kpb.AbortRemotePrefillResponse(found=False)  # its writes' fate is unknown
        # Between steps now: nothing more is posted for it; a write whose wait timed out may still land.
        return kpb.AbortRemotePrefillResponse(found=found, writes_settled=target is None or target.writes_settled)


def _check_target(request: kpb.RemotePrefillRequest, in_flight: dict[str, str]) -> tuple[str, str] | None:
    """None when the hand-off may start; else (why not, the field). Writes go only to the blocks the decode
    worker reserved for this transfer: each named once (the pool's bounds are checked per write,
    kv_transfer/layout.py)."""
    if len(request.transfer_id) < 16:
        return "must be an unguessable token", "transfer_id"
    if request.transfer_id in in_flight:
        return "already in flight", "transfer_id"
    if len(set(request.dst_block_ids)) != len(request.dst_block_ids):
        return "must not repeat a block", "dst_block_ids"
    return None


def _failed(code: int, message: str, field: str = "", settled: bool = False) -> kpb.RemotePrefillResponse:
    """`settled`: no write of the hand-off can land any more (none was posted, or all completed)."""
    return kpb.RemotePrefillResponse(error=pb.Error(code=code, message=message, field=field),
                                     writes_settled=settled)  # fmt: skip
