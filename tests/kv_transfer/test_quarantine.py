"""Quarantine: a hand-off abandoned while the prefill side's write into the reserved blocks is still on its
way. The engine holds those blocks (never handed to another request) until the lease ended, the late write
lands harmlessly in them, and afterwards every block is free. The decode side quarantines exactly when it
cannot know that no write can land any more (no answer, an abort that failed, writes_settled false)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.remote_prefill import RemoteTarget, quarantine, release, try_reserve
from flotilla.engine.sampling_params import SamplingParams
from flotilla.kv_transfer.copy_transport import CopyTransport

from tests.support.waiting import wait_until

from .engine_pair import EnginePair, decode_side_over, handed_off_request, layer_digests

BLOCK_SIZE = 4
NUM_BLOCKS = 32
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def _engine(checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(checkpoint), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                  max_num_batched_tokens=64))


def _assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine.reserved_request_ids
    assert engine.check_integrity()
    assert engine.kv_cache_manager.num_quarantined_blocks == 0
    assert engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS


class _StalledCopyTransport(CopyTransport):
    """While `gate` is closed a posted write waits: its bytes land only once it opens (a stalled RDMA write)."""

    def __init__(self, pool, name: str = ""):
        self.gate = threading.Event()
        self.gate.set()
        super().__init__(pool, name)

    def _carry_out(self, *job) -> None:
        self.gate.wait()
        super()._carry_out(*job)


def test_blocks_a_late_write_lands_in_are_not_reallocated_until_the_quarantine_ends(tiny_checkpoint):
    pair = EnginePair.build(_engine(tiny_checkpoint), _engine(tiny_checkpoint), _StalledCopyTransport)
    pair.sender.write_timeout_s = 0.2  # the step gives up waiting for the stalled write, which stays queued
    try:
        _run_stalled_handoff(pair, pair.sender.transport.gate)
    finally:
        pair.sender.transport.gate.set()
        pair.close()


def _run_stalled_handoff(pair: EnginePair, stalled: threading.Event) -> None:
    decode, prefill = pair.decode, pair.prefill
    stalled.clear()
    prompt = tuple(range(100, 117))  # 17 tokens: 5 blocks
    reservation = try_reserve(decode, NewRequest("victim", prompt, PARAMS))
    assert reservation is not None
    target = RemoteTarget("t-victim", pair.receiver.name, reservation.dst_block_ids, reservation.first_block_index)
    pair.sender.add_target("victim", target)
    prefill.add_request(NewRequest("victim", prompt, PARAMS))
    prefill.step()  # posts every layer's write; they stall, so the step's wait gives up
    assert target.error is not None and not target.writes_settled
    pair.sender.pop_target("victim")
    prefill.abort("victim")

    # The decode side abandons the hand-off: a write may still land, so the blocks are quarantined.
    until = time.monotonic() + 3600
    quarantine(decode, reservation, "t-victim", until)
    quarantined = set(reservation.dst_block_ids)
    assert decode.check_integrity()

    # Another request takes blocks meanwhile (its prefill runs here, colocated): none of the quarantined ones.
    other_prompt = tuple(range(300, 317))
    decode.add_request(NewRequest("other", other_prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    decode.step()
    other_blocks = decode.kv_cache_manager.block_ids("other")
    assert quarantined.isdisjoint(other_blocks)
    other_kv = layer_digests(decode, other_blocks, len(other_prompt))
    victim_kv_before = layer_digests(decode, reservation.dst_block_ids, len(prompt))

    stalled.set()  # the late write lands now: into the quarantined blocks, not into "other"'s
    wait_until(lambda: target.writes_settled, 10, "the stalled writes to complete", interval_s=0.01)
    assert layer_digests(decode, other_blocks, len(other_prompt)) == other_kv
    assert layer_digests(decode, reservation.dst_block_ids, len(prompt)) != victim_kv_before  # it did land
    assert decode.check_integrity() and decode.kv_cache_manager.num_quarantined_blocks == len(quarantined)

    assert decode.kv_cache_manager.release_expired_quarantine(until - 1) == 0  # not before its time
    assert decode.kv_cache_manager.release_expired_quarantine(until) == len(quarantined)
    while decode.has_unfinished_requests():
        decode.step()
    _assert_all_free(decode)
    _assert_all_free(prefill)


def test_engine_step_frees_an_expired_quarantine_and_the_request_id_is_free_at_once(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    prompt = tuple(range(3, 20))
    reservation = try_reserve(engine, NewRequest("r", prompt, PARAMS))
    quarantine(engine, reservation, "t-r", time.monotonic())  # already over
    engine.add_request(NewRequest("r", prompt, PARAMS))  # the local fallback reuses the request id
    assert set(engine.kv_cache_manager.block_ids("r")).isdisjoint(reservation.dst_block_ids)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_free(engine)


# ---- the decode side's decision --------------------------------------------------------------------
def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class _Peer:
    """The prefill worker's stub: RemotePrefill does `prefill` (a coroutine function), abort does `abort`."""

    def __init__(self, prefill, abort=None):
        self._prefill, self._abort = prefill, abort
        self.num_aborts = 0

    async def RemotePrefill(self, request, timeout):
        return await self._prefill(request)

    async def AbortRemotePrefill(self, request, timeout):
        self.num_aborts += 1
        return await self._abort(request)


async def _hang(request):
    await asyncio.Event().wait()


async def _gone(request):
    raise _rpc_error(grpc.StatusCode.UNAVAILABLE)


def _answer(settled: bool):
    async def answer(request):
        return kpb.RemotePrefillResponse(error=pb.Error(code=pb.ERROR_CODE_UNAVAILABLE, message="failed"),
                                         writes_settled=settled)
    return answer


def _abort_answer(settled: bool):
    async def answer(request):
        return kpb.AbortRemotePrefillResponse(found=True, writes_settled=settled)
    return answer


async def _abort_fails(request):
    raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)


CASES = {
    # name: (peer, cancel the call mid-prefill, quarantined)
    "cancelled, abort failed": (lambda: _Peer(_hang, _abort_fails), True, True),
    "cancelled, abort says a write may land": (lambda: _Peer(_hang, _abort_answer(False)), True, True),
    "cancelled, abort says settled": (lambda: _Peer(_hang, _abort_answer(True)), True, False),
    "prefill worker gone": (lambda: _Peer(_gone), False, True),
    "failed, a write may land": (lambda: _Peer(_answer(False)), False, True),
    "failed, settled": (lambda: _Peer(_answer(True)), False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_side_quarantines_when_a_write_may_still_land(tiny_checkpoint, case):
    make_peer, cancel, quarantined = CASES[case]
    llm, peer = _engine(tiny_checkpoint), make_peer()
    engine = AsyncEngine(lambda: llm)
    lease_s = 0.3
    handoff, decode_side = decode_side_over(engine, peer, lease_s)
    gen = handed_off_request()

    async def hand_off():
        await engine.start()
        opening = asyncio.ensure_future(decode_side.open_stream(gen, "127.0.0.1:2"))
        if cancel:
            while not handoff.incoming:  # reserved, RemotePrefill in flight
                await asyncio.sleep(0)
            opening.cancel()
            with pytest.raises(asyncio.CancelledError):
                await opening
            assert peer.num_aborts == 1
        else:
            assert await opening is None  # prefilled here instead
        held = await engine.call(lambda llm: llm.kv_cache_manager.num_quarantined_blocks)

        def reserve_another(llm):  # meanwhile a new reservation never gets a quarantined block
            other = try_reserve(llm, NewRequest("other", tuple(range(500, 537)), PARAMS))
            assert other is not None and llm.check_integrity()
            release(llm, other)

        await engine.call(reserve_another)
        deadline = time.monotonic() + 10
        while await engine.call(lambda llm: llm.kv_cache_manager.num_quarantined_blocks):
            assert time.monotonic() < deadline, "the idle engine did not end the quarantine"
            await asyncio.sleep(0.02)  # the engine thread frees them once the lease ended, idle or not
        await engine.shutdown()
        return held

    held = asyncio.run(hand_off())
    assert not handoff.incoming
    assert (held > 0) == quarantined, f"{held} blocks quarantined"
    _assert_all_free(llm)


# ---- the prefill side's answers ---------------------------------------------------------------------
def _prefill_side(target: RemoteTarget | None = None):
    from collections import OrderedDict

    from flotilla.worker.prefill_side import PrefillSide

    async def engine_abort(transfer_id):
        return target is not None

    async def ensure_peer(*args):
        return None

    handoff = SimpleNamespace(
        outgoing={}, aborted=OrderedDict(), finished=OrderedDict(), ensure_peer=ensure_peer,
        sender=SimpleNamespace(pop_target=lambda transfer_id: target), engine=SimpleNamespace(abort=engine_abort),
    )  # fmt: skip
    return PrefillSide(handoff)


def test_prefill_side_refuses_a_remote_prefill_its_abort_overtook():
    side, transfer_id = _prefill_side(), "x" * 32
    aborted = asyncio.run(side.abort(kpb.AbortRemotePrefillRequest(transfer_id=transfer_id), "decode"))
    assert not aborted.found and aborted.writes_settled  # nothing was written for it
    request = kpb.RemotePrefillRequest(transfer_id=transfer_id, decode_agent_name="a", dst_block_ids=[1, 2])
    answer = asyncio.run(side.remote_prefill(request, None, "decode"))
    assert answer.HasField("error") and "aborted" in answer.error.message and answer.writes_settled


def test_prefill_side_abort_says_when_a_timed_out_write_may_still_land():
    from flotilla.kv_transfer.transport import WriteTicket

    target = RemoteTarget("y" * 32, "a", [1], 0)
    target.unsettled.append(WriteTicket(64))  # its wait gave up; NIXL may still carry it out
    answer = asyncio.run(_prefill_side(target).abort(kpb.AbortRemotePrefillRequest(transfer_id="y" * 32), "d"))
    assert answer.found and not answer.writes_settled
    target.unsettled[0].finish("failed")
    answer = asyncio.run(_prefill_side(target).abort(kpb.AbortRemotePrefillRequest(transfer_id="y" * 32), "d"))
    assert answer.writes_settled
