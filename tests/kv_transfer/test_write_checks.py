"""The receiving side's checks on the write path: a write notification counts only for a transfer the decode
side opened, only naming blocks reserved for that transfer, in a layer of the pool, all from the prefill
worker's own agent. Over real NIXL, a sender whose target names a block that is not reserved for the transfer
gets the hand-off refused; the decode side then quarantines the blocks and prefills the request itself."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.remote_prefill import RemoteTarget, release, try_reserve
from flotilla.engine.sampling_params import SamplingParams
from flotilla.kv_transfer.arrivals import ArrivalTracker, encode_blocks, notif_message
from flotilla.kv_transfer.nixl_transport import NixlTransport

from tests.support.waiting import wait_until

from .engine_pair import EnginePair, decode_side_over, handed_off_request

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def test_blocks_travel_as_ranges():
    assert encode_blocks([3, 4, 5, 9, 11, 12]) == "3-5,9,11-12"
    assert notif_message("t", 2, [7]) == b"t:2:7"


def test_notifications_for_no_open_transfer_are_dropped_and_keep_no_state():
    tracker = ArrivalTracker(num_layers=4)
    for i in range(10_000):
        tracker.on_notif("stranger", notif_message(f"guess{i}", 0, [1]))
    assert tracker.num_refused == 10_000 and not tracker._transfers


@pytest.mark.parametrize("message, why", [
    (notif_message("t", 0, [5, 9]), "blocks 9 are not all reserved"),
    (notif_message("t", 0, []), "names no block"),
    (b"t:0:0-4000000000", "are not all reserved"),  # refused without expanding the range
    (b"t:0:5;6", "malformed"),
    (notif_message("t", 4, [5]), "names layer '4'"),
    (b"t:x:5", "names layer 'x'"),
])  # fmt: skip
def test_a_notification_outside_the_transfer_marks_it_violated_and_wakes_the_waiter(message, why):
    tracker = ArrivalTracker(num_layers=4)
    tracker.open("t", [5, 6])

    async def scenario():
        waiter = tracker.expect("t", 8)
        tracker.on_notif("prefill", message)
        await asyncio.wait_for(waiter, 5)  # woken at once, not after the lease

    asyncio.run(scenario())
    assert why in tracker.check("t", "prefill") and tracker.num_arrived("t") == 0


def test_notifications_from_another_agent_than_the_prefill_workers_are_refused():
    tracker = ArrivalTracker(num_layers=4)
    tracker.open("t", [5, 6])
    tracker.on_notif("intruder", notif_message("t", 0, [5]))
    assert "from ['intruder']" in tracker.check("t", "prefill")
    tracker.on_notif("prefill", notif_message("t", 1, [6]))
    assert "second agent" in tracker.check("t", "prefill")


def _engine(checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(checkpoint), num_kv_blocks=32, block_size=4,
                                  max_num_batched_tokens=64))


def test_over_nixl_a_write_into_a_block_not_reserved_for_the_transfer_is_caught(tiny_checkpoint):
    try:
        pair = EnginePair.build(_engine(tiny_checkpoint), _engine(tiny_checkpoint), NixlTransport)
    except Exception as exc:
        pytest.skip(f"NIXL's UCX backend does not start here: {exc}")
    try:
        decode, prefill = pair.decode, pair.prefill
        prompt = tuple(range(100, 117))
        honest = try_reserve(decode, NewRequest("honest", prompt, PARAMS))
        victim = try_reserve(decode, NewRequest("victim", tuple(range(200, 217)), PARAMS))
        pair.arrivals.open("t-honest", honest.dst_block_ids)
        # A stale or buggy target: its last block is the victim's, not reserved for this transfer.
        wrong = honest.dst_block_ids[:-1] + victim.dst_block_ids[:1]
        target = RemoteTarget("t-honest", pair.receiver.name, wrong, honest.first_block_index)
        pair.sender.add_target("honest", target)
        prefill.add_request(NewRequest("honest", prompt, PARAMS))
        prefill.step()
        assert target.error is None and target.num_writes > 0  # NIXL carried the writes out
        wait_until(lambda: pair.arrivals.num_refused >= target.num_writes, 10, "the notifications to arrive",
                   interval_s=0.005)  # fmt: skip
        problem = pair.arrivals.check("t-honest", pair.sender.transport.name)
        assert problem is not None and f"blocks {victim.dst_block_ids[0]} are not all reserved" in problem
        pair.sender.pop_target("honest")
        prefill.abort("honest")
        release(decode, honest)
        release(decode, victim)
        assert decode.check_integrity() and decode.kv_cache_manager.num_free_blocks == 32
    finally:
        pair.close()


@pytest.mark.parametrize("case", ["foreign block", "foreign agent"])
def test_decode_side_refuses_the_hand_off_and_quarantines(tiny_checkpoint, case):
    llm = _engine(tiny_checkpoint)
    engine = AsyncEngine(lambda: llm)
    arrivals = ArrivalTracker(num_layers=len(llm.runner.kv_caches))
    counters = SimpleNamespace(num_local_fallbacks=0, num_refused_handoffs=0)

    class Peer:  # the prefill worker: notifies as its writes land, then answers "done, every write settled"
        async def RemotePrefill(self, request, timeout):
            blocks = list(request.dst_block_ids)
            if case == "foreign block":
                blocks[-1] = max(set(range(32)) - set(blocks))
            agent = "prefill-agent" if case == "foreign block" else "someone-else"
            arrivals.on_notif(agent, notif_message(request.transfer_id, 0, blocks))
            return kpb.RemotePrefillResponse(first_token_id=7, num_writes=1, writes_settled=True,
                                             prefill_agent_name="prefill-agent")

    handoff, decode_side = decode_side_over(engine, Peer(), 0.2, arrivals, counters)
    gen = handed_off_request()

    async def hand_off():
        await engine.start()
        assert await decode_side.open_stream(gen, "127.0.0.1:2") is None  # prefilled here instead
        held = await engine.call(lambda llm: llm.kv_cache_manager.num_quarantined_blocks)
        while await engine.call(lambda llm: llm.kv_cache_manager.num_quarantined_blocks):
            await asyncio.sleep(0.02)  # the engine ends the quarantine once the lease ended
        await engine.shutdown()
        return held

    assert asyncio.run(asyncio.wait_for(hand_off(), 10)) > 0  # its word that all settled is not taken
    assert counters.num_refused_handoffs == 1 and counters.num_local_fallbacks == 1
    assert llm.check_integrity() and llm.kv_cache_manager.num_free_blocks == 32
