"""Nothing lost, nothing leaked: requests cancelled at random moments (queued, mid-prefill, holding a decode
reservation, during the KV hand-off with the reservation freed or quarantined, before admission, a failed
admission, mid-decode), colocated (1,000) and disaggregated over the copy transport (1,000) and over real NIXL
(UCX, two agents in this process; 1,000). Afterwards every pool is all-free (the prefix cache's cached-but-free
blocks count as free) and check_integrity, which reports block tables of no live request, holds."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.kv_cache_manager import KVCacheIntegrityError
from flotilla.engine.new_request import NewRequest
from flotilla.engine.remote_prefill import RemoteTarget, quarantine, release, try_reserve
from flotilla.engine.sampling_params import SamplingParams
from flotilla.kv_transfer.copy_transport import CopyTransport
from flotilla.kv_transfer.nixl_transport import NixlTransport

from flotilla.worker.decode_side import DecodeSide

from tests.support.waiting import wait_until

from .engine_pair import EnginePair

BLOCK_SIZE = 4
NUM_BLOCKS = 64
SEED = 17


def _engine(checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(checkpoint), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                  max_num_batched_tokens=32))


def _prompt(rng: random.Random) -> tuple[int, ...]:
    shared = [5, 6, 7, 8, 9, 10, 11, 12][: rng.choice([0, 4, 8])]  # some prompts share a cached prefix
    return tuple(shared + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 14))])


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randrange(1, 4), temperature=0.0, ignore_eos=True)


def _assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine.reserved_request_ids
    assert engine.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS  # free counts cached-but-free blocks


def test_colocated_random_aborts_leak_nothing(tiny_checkpoint):
    rng, engine = random.Random(SEED), _engine(tiny_checkpoint)
    live: list[str] = []
    for i in range(1000):
        engine.add_request(NewRequest(f"c{i}", _prompt(rng), _params(rng)))
        live.append(f"c{i}")
        if rng.random() < 0.3:  # queued (just added) or mid-prefill / mid-decode (added earlier)
            engine.abort(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.5:
            finished = {out.request_id for out in engine.step() if out.finished}
            live = [r for r in live if r not in finished]
            assert engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_free(engine)


class _Disaggregated:
    """Drives requests through reserve -> remote prefill -> hand-off -> admission -> decode, one phase a time."""

    def __init__(self, pair: EnginePair, rng: random.Random):
        self.pair, self.rng = pair, rng
        self.reserved: dict[str, object] = {}  # request id -> reservation, prefill not yet started
        self.prefilling: dict[str, tuple[object, RemoteTarget]] = {}
        self.arrived: dict[str, tuple[object, int]] = {}  # prefill done: reservation, first token
        self.decoding: set[str] = set()
        self.counts = {"reserve": 0, "cancel_reserved": 0, "cancel_prefill": 0, "quarantine_prefill": 0,
                       "cancel_handoff": 0, "failed_admit": 0, "cancel_decode": 0}

    def reserve(self, request_id: str) -> None:
        reservation = try_reserve(self.pair.decode, NewRequest(request_id, _prompt(self.rng), _params(self.rng)))
        if reservation is not None:
            self.reserved[request_id] = reservation
            self.counts["reserve"] += 1

    def start_prefill(self, request_id: str) -> None:
        reservation = self.reserved.pop(request_id)
        target = RemoteTarget(f"t-{request_id}", self.pair.receiver.name, reservation.dst_block_ids,
                              reservation.first_block_index)
        self.pair.sender.add_target(request_id, target)
        request = reservation.request
        self.pair.prefill.add_request(NewRequest(request_id, tuple(request.prompt_token_ids),
                                                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        self.prefilling[request_id] = (reservation, target)

    def step_prefill(self) -> None:
        for out in self.pair.prefill.step():
            if out.request_id in self.prefilling and out.new_token_ids:
                reservation, target = self.prefilling.pop(out.request_id)
                self.pair.sender.pop_target(out.request_id)
                self.pair.prefill.abort(out.request_id)
                assert target.error is None, target.error
                self.arrived[out.request_id] = (reservation, out.new_token_ids[0])

    def cancel(self, phase: str) -> None:
        decode = self.pair.decode
        if phase == "cancel_reserved" and self.reserved:
            release(decode, self.reserved.pop(self._pick(self.reserved)))
        elif phase == "cancel_prefill" and self.prefilling:
            request_id = self._pick(self.prefilling)
            reservation, _ = self.prefilling.pop(request_id)
            self.pair.sender.pop_target(request_id)
            self.pair.prefill.abort(request_id)
            release(decode, reservation)
        elif phase == "quarantine_prefill" and self.prefilling:  # abandoned with a write maybe in flight
            request_id = self._pick(self.prefilling)
            reservation, target = self.prefilling.pop(request_id)
            self.pair.sender.pop_target(request_id)
            self.pair.prefill.abort(request_id)
            # Held until a later decode step (which sweeps) passes its end; a retry reuses the id at once.
            quarantine(decode, reservation, target.transfer_id, time.monotonic() + self.rng.choice([0, 0.005, 0.05]))
        elif phase == "cancel_handoff" and self.arrived:
            release(decode, self.arrived.pop(self._pick(self.arrived))[0])
        elif phase == "failed_admit" and self.arrived:
            reservation, first = self.arrived.pop(self._pick(self.arrived))
            adopt = decode.scheduler.adopt_running
            decode.scheduler.adopt_running = _refuse  # the admission fails after the blocks are published
            try:
                with pytest.raises(RuntimeError, match="refused"):
                    decode.add_prefilled_request(reservation.request, first)
            finally:
                decode.scheduler.adopt_running = adopt
        elif phase == "cancel_decode" and self.decoding:
            request_id = self._pick(self.decoding)
            self.decoding.discard(request_id)
            assert decode.abort(request_id)
        else:
            return
        self.counts[phase] += 1

    def admit_and_step_decode(self) -> None:
        for request_id in list(self.arrived):
            reservation, first = self.arrived.pop(request_id)
            if not self.pair.decode.add_prefilled_request(reservation.request, first).finished:
                self.decoding.add(request_id)
        for out in self.pair.decode.step():
            if out.finished:
                self.decoding.discard(out.request_id)

    def _pick(self, ids) -> str:
        return self.rng.choice(sorted(ids))

    @property
    def busy(self) -> bool:
        return bool(self.reserved or self.prefilling or self.arrived or self.decoding)


def _refuse(request):
    raise RuntimeError("refused")


def _pair(checkpoint, transport_cls) -> EnginePair:
    prefill, decode = _engine(checkpoint), _engine(checkpoint)
    try:
        return EnginePair.build(prefill, decode, transport_cls)
    except Exception as exc:  # the agent could not start: no UCX transport on this machine
        if transport_cls is NixlTransport:
            pytest.skip(f"NIXL's UCX backend does not start here: {exc}")
        raise


@pytest.mark.parametrize("transport_cls", [CopyTransport, NixlTransport])
def test_disaggregated_random_cancels_leak_nothing(tiny_checkpoint, transport_cls):
    pair = _pair(tiny_checkpoint, transport_cls)
    flow = _Disaggregated(pair, random.Random(SEED))
    phases = ["cancel_reserved", "cancel_prefill", "quarantine_prefill", "cancel_handoff", "failed_admit",
              "cancel_decode"]
    try:
        for i in range(1000):
            flow.reserve(f"d{i}")
            for request_id in list(flow.reserved):
                if flow.rng.random() < 0.7:
                    flow.start_prefill(request_id)
            if flow.rng.random() < 0.4:
                flow.cancel(flow.rng.choice(phases))
            flow.step_prefill()
            if flow.rng.random() < 0.2:
                flow.cancel(flow.rng.choice(phases))
            # Writes a step posted have all landed once step() returns (the sender settles them).
            flow.admit_and_step_decode()
            assert pair.decode.check_integrity() and pair.prefill.check_integrity()
        for request_id in list(flow.reserved):
            flow.start_prefill(request_id)
        for _ in range(1000):
            if not flow.busy:
                break
            flow.step_prefill()
            flow.admit_and_step_decode()
        assert not flow.busy, (flow.reserved, flow.prefilling, flow.arrived, flow.decoding)
        kv = pair.decode.kv_cache_manager
        wait_until(lambda: pair.decode.step() == [] and kv.num_quarantined_blocks == 0, 5,
                   "the last quarantines to end", interval_s=0.01)  # step() sweeps expired ones
        _assert_all_free(pair.decode)
        _assert_all_free(pair.prefill)
        assert all(flow.counts.values()), flow.counts  # every phase was cancelled at least once
    finally:
        pair.close()


def test_engine_integrity_reports_a_reservation_nobody_holds(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    reservation = try_reserve(engine, NewRequest("r", tuple(range(3, 20)), params))
    assert reservation is not None and engine.check_integrity()
    with pytest.raises(KVCacheIntegrityError, match="request r: holds device blocks .* but is not live"):
        engine.check_integrity(reserved_request_ids=())  # its holder (the decode side) forgot it
    engine.reserved_request_ids.clear()
    with pytest.raises(KVCacheIntegrityError, match="request r"):
        engine.check_integrity()
    engine.reserved_request_ids.add("r")
    release(engine, reservation)
    _assert_all_free(engine)


class _GatedEngine:
    """AsyncEngine.call's contract: the function runs on the engine even if its caller stops waiting."""

    def __init__(self, llm: LLMEngine):
        self.llm, self.gate, self.threads = llm, asyncio.Event(), []

    async def call(self, fn):
        ack = asyncio.get_running_loop().create_future()

        async def engine_thread():  # submitted at once; runs fn even when nobody awaits its answer any more
            await self.gate.wait()
            result = fn(self.llm)
            if not ack.done():
                ack.set_result(result)

        self.threads.append(asyncio.ensure_future(engine_thread()))
        return await ack


def test_decode_side_releases_a_reservation_whose_wait_was_cancelled(tiny_checkpoint):
    engine = _GatedEngine(_engine(tiny_checkpoint))
    decode_side = DecodeSide(SimpleNamespace(engine=engine), "127.0.0.1:1")
    new = NewRequest("r", tuple(range(3, 20)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))

    async def cancel_while_reserving():
        waiting = asyncio.ensure_future(decode_side._reserve(new, 1))
        while not engine.threads:  # the call is submitted to the engine
            await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        engine.gate.set()  # the reservation lands only now, after its caller left
        for _ in range(20):
            await asyncio.sleep(0)

    asyncio.run(cancel_while_reserving())
    _assert_all_free(engine.llm)
