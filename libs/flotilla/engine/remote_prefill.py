"""Disaggregated prefill, engine side.

Prefill side: `KVSender` is the model runner's KV hook. For each request it prefills for a decode worker it
knows a `RemoteTarget` (peer, the decode side's reserved block ids). After every layer of a step it posts one
write per such request with the blocks that step touched (the last, partial block again next chunk), so the
transfer of layer i overlaps the compute of layer i+1. At the end of the step it waits for the step's writes:
the source blocks stay valid until the bytes landed, and a later chunk's rewrite of a partial block can never
be overtaken by the earlier write of it. A failed or overdue write marks the target failed (the worker then
aborts the request and frees its blocks); nothing more is written for it.

Decode side: `try_reserve` allocates the destination blocks of a request (after its own prefix-cache hit,
whole blocks only, so no copy-on-write) without publishing them in the prefix cache, since their K/V have
not arrived; `release` frees them; `quarantine` holds them instead when the hand-off was abandoned while a
peer's write into them may still be in flight, until its lease ended; `LLMEngine.add_prefilled_request`
admits the request once every write has arrived. All of these run on the engine thread.

Leases: a prefill worker posts no write for a target after its deadline (RemoteTarget.deadline, its own clock:
the receipt of RemotePrefill + the lease, never later than the decode side's reservation + the lease).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from flotilla.engine.engine import LLMEngine
from flotilla.engine.kv_cache_manager import ComputedBlocks
from flotilla.engine.new_request import NewRequest
from flotilla.engine.request import Request
from flotilla.engine.scheduler_output import SchedulerOutput
from flotilla.kv_transfer.arrivals import notif_message
from flotilla.kv_transfer.transport import KVTransferError, KVTransport, WriteTicket, wait_all


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- prefill side ------------------------------------------------------------------------------------
@dataclass
class RemoteTarget:
    """Where one request's prompt K/V go: block index i (i >= first_block_index) -> dst_block_ids[i - first]."""

    transfer_id: str
    peer: str  # the decode worker's transport agent name
    dst_block_ids: list[int]
    first_block_index: int  # blocks before this one the decode worker holds already (its prefix cache)
    next_block_index: int = 0  # first block not yet shipped in full
    num_writes: int = 0  # completed writes = notifications the decode side will see
    num_bytes: int = 0
    error: str | None = None
    deadline: float = float("inf")  # time.monotonic(): no write is posted after it
    # Writes whose wait gave up (timed out) but which NIXL may still carry out.
    unsettled: list[WriteTicket] = field(default_factory=list)

    @property
    def writes_settled(self) -> bool:
        """No write of this target can land any more (call between engine steps)."""
        return all(ticket.done for ticket in self.unsettled)


@dataclass
class _Planned:
    target: RemoteTarget
    src_block_ids: list[int]
    dst_block_ids: list[int]
    end: int  # tokens covered after this step
    tickets: list[WriteTicket] = field(default_factory=list)


class KVSender:
    def __init__(self, transport: KVTransport, block_size: int, layerwise: bool = True, write_timeout_s: float = 30.0):
        self.transport = transport
        self.block_size = block_size
        self.layerwise = layerwise  # False: one write per layer after the whole forward pass (benchmark baseline)
        self.write_timeout_s = write_timeout_s
        self._num_layers = transport.local_info().layout.num_layers
        self._lock = threading.Lock()
        self._targets: dict[str, RemoteTarget] = {}
        self._plan: list[_Planned] = []

    def add_target(self, request_id: str, target: RemoteTarget) -> None:
        target.next_block_index = max(target.next_block_index, target.first_block_index)
        with self._lock:
            self._targets[request_id] = target

    def pop_target(self, request_id: str) -> RemoteTarget | None:
        with self._lock:
            return self._targets.pop(request_id, None)

    @property
    def num_targets(self) -> int:
        return len(self._targets)

    # ---- StepKVHook (engine thread) --------------------------------------------------------------
    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        with self._lock:
            targets = dict(self._targets)
        self._plan = []
        for chunk in scheduler_output.chunks:
            target = targets.get(chunk.request.request_id)
            if target is None or target.error is not None:
                continue
            planned = self._plan_chunk(target, chunk.block_ids, chunk.end)
            if planned is not None:
                self._plan.append(planned)

    def on_layer(self, layer_index: int) -> None:
        if self.layerwise:
            for planned in self._plan:
                self._post(planned, layer_index)

    def end_step(self) -> None:
        if not self.layerwise:
            for layer_index in range(self._num_layers):
                for planned in self._plan:
                    self._post(planned, layer_index)
        for planned in self._plan:
            self._settle(planned)
        self._plan = []

    # ---- internals -------------------------------------------------------------------------------
    def _plan_chunk(self, target: RemoteTarget, block_ids: Sequence[int], end: int) -> _Planned | None:
        first, stop = target.next_block_index, _cdiv(end, self.block_size)
        if time.monotonic() > target.deadline:
            target.error = "the hand-off's lease ended"
            return None
        if stop - target.first_block_index > len(target.dst_block_ids):
            target.error = f"prefill reached block {stop - 1}, beyond the {len(target.dst_block_ids)} reserved"
            return None
        if stop <= first:
            return None
        offset = target.first_block_index
        return _Planned(target, list(block_ids[first:stop]), target.dst_block_ids[first - offset : stop - offset], end)

    def _post(self, planned: _Planned, layer_index: int) -> None:
        target = planned.target
        if time.monotonic() > target.deadline:  # the decode side may have quarantined and freed the blocks
            target.error = "the hand-off's lease ended"
            return
        try:
            ticket = self.transport.write_layer(
                target.peer, layer_index, planned.src_block_ids, planned.dst_block_ids,
                notif_message(target.transfer_id, layer_index, planned.dst_block_ids),
            )  # fmt: skip
        except (KVTransferError, ValueError) as exc:
            target.error = str(exc)
            return
        planned.tickets.append(ticket)

    def _settle(self, planned: _Planned) -> None:
        target = planned.target
        try:
            wait_all(planned.tickets, self.write_timeout_s)
        except KVTransferError as exc:
            target.error = str(exc)
            target.unsettled.extend(ticket for ticket in planned.tickets if not ticket.done)
            return
        if target.error is not None:
            return
        target.num_writes += len(planned.tickets)
        target.num_bytes += sum(ticket.num_bytes for ticket in planned.tickets)
        target.next_block_index = planned.end // self.block_size


# ---- decode side -------------------------------------------------------------------------------------
class KVReservation(NamedTuple):
    request: Request
    first_block_index: int  # blocks before it came from this worker's prefix cache
    dst_block_ids: list[int]  # reserved blocks for block indices first_block_index..

    @property
    def num_cached_tokens(self) -> int:
        return self.request.num_computed_tokens


def try_reserve(engine: LLMEngine, new: NewRequest, min_remote_tokens: int = 1) -> KVReservation | None:
    """Reserve blocks for a remote prefill of this request (a resumed stream's too, add_request), or None when
    it should be prefilled here: its uncached part is shorter than `min_remote_tokens`, or its projected KV
    does not fit now. Raises InvalidRequestError like add_request."""
    request = engine.new_request(new)
    kv = engine.kv_cache_manager
    hit = kv.get_computed_blocks(request)
    num_cached_blocks = hit.num_tokens // kv.block_size  # whole blocks only: no copy-on-write of a tail
    computed = ComputedBlocks(hit.block_ids[:num_cached_blocks], num_cached_blocks * kv.block_size)
    num_uncached = request.num_prompt_tokens - computed.num_tokens
    if num_uncached < max(1, min_remote_tokens):
        return None
    lookahead = min(engine.config.num_lookahead_steps, new.sampling_params.max_tokens)
    if not kv.can_fit(kv.num_blocks_needed(request, request.num_prompt_tokens + lookahead, computed)):
        return None
    if kv.allocate_slots(request, num_uncached, computed, publish=False) is None:
        return None
    engine.reserved_request_ids.add(request.request_id)
    return KVReservation(request, num_cached_blocks, kv.block_ids(new.request_id)[num_cached_blocks:])


def release(engine: LLMEngine, reservation: KVReservation) -> None:
    """Free a reservation that will not be admitted (abort, timeout, failed prefill)."""
    engine.kv_cache_manager.free(reservation.request)
    engine.reserved_request_ids.discard(reservation.request.request_id)


def quarantine(engine: LLMEngine, reservation: KVReservation, key: str, until: float) -> None:
    """A reservation that will not be admitted, while a peer's write into it may still land: its reserved
    blocks stay held (never handed to another request) until `until` (time.monotonic()); the engine frees
    them then (LLMEngine.release_expired_quarantine, at every step and on an idle AsyncEngine). The request
    id may be used again at once (a local prefill)."""
    engine.kv_cache_manager.quarantine(reservation.request, reservation.first_block_index, key, until)
    engine.reserved_request_ids.discard(reservation.request.request_id)

