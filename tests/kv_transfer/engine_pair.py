"""Two engines in this process joined by a KV transport: a prefill side with a KVSender hook and a decode
side that reserves blocks, counts arrivals and admits the request. Drives them synchronously."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.engine import LLMEngine
from flotilla.engine.model.kv_cache import kv_pool_tensor
from flotilla.engine.new_request import NewRequest
from flotilla.engine.remote_prefill import KVReservation, KVSender, RemoteTarget, try_reserve
from flotilla.engine.sampling_params import SamplingParams
from flotilla.kv_transfer.arrivals import ArrivalTracker
from flotilla.kv_transfer.transport import KVTransport
from flotilla.worker.decode_side import DecodeSide

from tests.support.waiting import wait_until


@dataclass
class EnginePair:
    prefill: LLMEngine
    decode: LLMEngine
    sender: KVSender
    receiver: KVTransport
    arrivals: ArrivalTracker

    @classmethod
    def build(cls, prefill: LLMEngine, decode: LLMEngine, transport_cls: type[KVTransport], layerwise=True):
        sender_transport = transport_cls(kv_pool_tensor(prefill.runner.kv_caches))
        receiver = transport_cls(kv_pool_tensor(decode.runner.kv_caches))
        arrivals = ArrivalTracker(len(decode.runner.kv_caches))
        receiver.set_notif_handler(arrivals.on_notif)
        sender_transport.connect(receiver.local_info())
        sender = KVSender(sender_transport, prefill.block_size, layerwise=layerwise)
        prefill.runner.kv_hook = sender
        return cls(prefill, decode, sender, receiver, arrivals)

    def close(self) -> None:
        self.prefill.runner.kv_hook = None
        self.sender.transport.close()
        self.receiver.close()

    def prefill_remotely(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[KVReservation, int]:
        """Reserve on the decode side, prefill on the prefill side (its request stays unfinished, so its blocks
        can be inspected), wait for every write; returns the reservation and the first token."""
        reservation = try_reserve(self.decode, NewRequest(request_id, tuple(prompt), params))
        if reservation is None:
            raise RuntimeError("decode side refused the reservation")
        transfer_id = f"t-{request_id}"
        self.arrivals.open(transfer_id, reservation.dst_block_ids)
        target = RemoteTarget(transfer_id, self.receiver.name, reservation.dst_block_ids, reservation.first_block_index)
        self.sender.add_target(request_id, target)
        first_only = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.prefill.add_request(NewRequest(request_id, tuple(prompt), first_only))
        first = None
        while first is None:
            for output in self.prefill.step():
                if output.request_id == request_id and output.new_token_ids:
                    first = output.new_token_ids[0]
        self.sender.pop_target(request_id)
        if target.error is not None:
            raise RuntimeError(target.error)
        wait_until(lambda: self.arrivals.num_arrived(transfer_id) >= target.num_writes, 30,
                   "every write to arrive", interval_s=0.001)
        return reservation, first


def layer_digests(engine: LLMEngine, block_ids: list[int], num_tokens: int) -> list[str]:
    """sha256 per layer of the K and V of the first `num_tokens` token slots of `block_ids`."""
    digests = []
    ids = torch.tensor(block_ids, dtype=torch.int64)
    for layer in engine.runner.kv_caches:
        kv = layer[:, ids].reshape(2, -1, *layer.shape[-2:])[:, :num_tokens].contiguous()
        digests.append(hashlib.sha256(kv.cpu().numpy().tobytes()).hexdigest())
    return digests


def decode_side_over(engine: AsyncEngine, peer, lease_s: float, arrivals: ArrivalTracker | None = None,
                     counters: SimpleNamespace | None = None) -> tuple[SimpleNamespace, DecodeSide]:
    """A decode worker's hand-off (DecodeSide, no quarantine grace) over `engine`, whose RemotePrefill goes to
    `peer` (the prefill worker, scripted by the test): (the hand-off's seam, the DecodeSide)."""
    handoff = SimpleNamespace(
        engine=engine, settings=SimpleNamespace(min_remote_prefill_tokens=1, lease_s=lease_s), incoming={},
        arrivals=ArrivalTracker() if arrivals is None else arrivals,
        transport=SimpleNamespace(name="decode-agent"),
        counters=SimpleNamespace(num_local_fallbacks=0) if counters is None else counters,
        peer_stub=lambda address: peer,
    )
    return handoff, DecodeSide(handoff, "127.0.0.1:1", quarantine_grace_s=0.0)


def handed_off_request() -> pb.GenerateRequest:
    """The request the hand-off tests send: 37 prompt tokens, 2 greedy output tokens."""
    return pb.GenerateRequest(request_id="r", prompt_token_ids=list(range(3, 40)),
                              sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
