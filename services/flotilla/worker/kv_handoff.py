"""What both sides of a KV hand-off share in one worker: the transport (NIXL agent over the whole KV pool),
arrival counting, the sender hooked into the model runner, channels to peers, and counters."""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from flotilla.api.kvtransfer.v1 import kv_transfer_pb2 as kpb
from flotilla.api.kvtransfer.v1 import kv_transfer_pb2_grpc
from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.model.kv_cache import kv_pool_tensor
from flotilla.engine.remote_prefill import KVReservation, KVSender, RemoteTarget
from flotilla.kv_transfer.arrivals import ArrivalTracker
from flotilla.kv_transfer.layout import KVPoolLayout, PeerInfo
from flotilla.kv_transfer.nixl_transport import NixlTransport
from flotilla.kv_transfer.transport import KVTransport
from flotilla.rpc.options import aio_channel
from flotilla.rpc.tls import InternalTLS
from flotilla.worker.kv_settings import DisaggSettings


@dataclass
class HandoffCounters:
    num_completed: int = 0
    num_failed: int = 0
    num_bytes_sent: int = 0
    num_local_fallbacks: int = 0
    num_refused_handoffs: int = 0  # a write notification failed its checks (arrivals.py)


@dataclass
class KVHandoff:
    engine: AsyncEngine
    settings: DisaggSettings
    transport: KVTransport
    arrivals: ArrivalTracker
    sender: KVSender
    counters: HandoffCounters = field(default_factory=HandoffCounters)
    incoming: dict[str, KVReservation] = field(default_factory=dict)  # decode side: transfer id -> reservation
    # Prefill side: transfer id in flight -> the identity of the decode worker that asked for it.
    outgoing: dict[str, str] = field(default_factory=dict)
    # Prefill side, recently ended hand-offs: their targets (whether a write may still land, for a late
    # AbortRemotePrefill) and the aborted ids (a RemotePrefill that arrives after its abort is refused).
    finished: OrderedDict[str, RemoteTarget] = field(default_factory=OrderedDict)
    aborted: OrderedDict[str, None] = field(default_factory=OrderedDict)
    tls: InternalTLS | None = None  # for channels to peers (workers)
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    _peer_locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    @classmethod
    async def start(cls, engine: AsyncEngine, settings: DisaggSettings, worker_id: str,
                    tls: InternalTLS | None = None) -> KVHandoff:
        pool = kv_pool_tensor(engine.engine.runner.kv_caches)
        transport = await asyncio.to_thread(NixlTransport, pool, f"{worker_id}-{uuid.uuid4().hex[:8]}")
        arrivals = ArrivalTracker(transport.local_info().layout.num_layers)
        transport.set_notif_handler(arrivals.on_notif)
        sender = KVSender(transport, engine.engine.block_size, settings.layerwise, settings.lease_s)
        await engine.call(lambda llm: setattr(llm.runner, "kv_hook", sender))
        return cls(engine, settings, transport, arrivals, sender, tls=tls)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        await asyncio.to_thread(self.transport.close)

    def peer_stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self.tls, "worker")
        return kv_transfer_pb2_grpc.KVTransferServiceStub(channel)

    def transfer_info(self) -> kpb.TransferInfo:
        info = self.transport.local_info()
        layout = info.layout
        return kpb.TransferInfo(
            agent_name=info.agent_name,
            metadata=info.metadata,
            layout=kpb.KVPoolLayout(
                num_layers=layout.num_layers, num_blocks=layout.num_blocks, block_bytes=layout.block_bytes,
                base_address=layout.base_address, device_id=layout.device_id, mem_type=layout.mem_type,
            ),
            block_size=self.engine.engine.block_size,
            model_version=self.engine.engine.model_version,
            kv_cache_format=self.engine.engine.kv_cache_format,
        )  # fmt: skip

    async def ensure_peer(self, agent_name: str, address: str, transfer_id: str, timeout_s: float) -> None:
        """Connect to a decode worker's agent once; later hand-offs reuse the cached connection. The decode
        worker tells its metadata only for a hand-off in flight (`transfer_id`)."""
        if self.transport.is_connected(agent_name):
            return
        lock = self._peer_locks.setdefault(agent_name, asyncio.Lock())
        async with lock:
            if self.transport.is_connected(agent_name):
                return
            info = await self.peer_stub(address).GetTransferInfo(kpb.GetTransferInfoRequest(transfer_id=transfer_id),
                                                                 timeout=timeout_s)  # fmt: skip
            if info.agent_name != agent_name:
                raise ValueError(f"{address} is agent {info.agent_name}, not {agent_name} (restarted?)")
            if info.model_version != self.engine.engine.model_version:
                raise ValueError(f"{address} serves model version {info.model_version}")
            if info.kv_cache_format != self.engine.engine.kv_cache_format:
                raise ValueError(f"{address} caches KV as {info.kv_cache_format!r}, this worker as "
                                 f"{self.engine.engine.kv_cache_format!r}")
            await asyncio.to_thread(self.transport.connect, _peer_info(info))


MAX_REMEMBERED = 4096  # recently ended / aborted hand-offs kept per kind


def remember(entries: OrderedDict, key: str, value=None) -> None:
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > MAX_REMEMBERED:
        entries.popitem(last=False)


def _peer_info(info: kpb.TransferInfo) -> PeerInfo:
    layout = info.layout
    return PeerInfo(
        info.agent_name,
        info.metadata,
        KVPoolLayout(layout.num_layers, layout.num_blocks, layout.block_bytes, layout.base_address,
                     layout.device_id, layout.mem_type),  # fmt: skip
    )
