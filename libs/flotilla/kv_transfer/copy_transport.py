"""In-process transport: peers are pools in this same process and a write is a tensor copy, run on the
transport's own thread like the NIXL one. The baseline for benchmarks (how fast a plain copy is) and a
transport for engine tests that need no second process."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Sequence

import torch

from flotilla.kv_transfer.layout import KVPoolLayout, PeerInfo
from flotilla.kv_transfer.transport import KVTransferError, KVTransport, NotifHandler, WriteTicket

_registry: dict[str, CopyTransport] = {}  # agent name -> transport, for peers in this process
_registry_lock = threading.Lock()


class CopyTransport(KVTransport):
    def __init__(self, pool: torch.Tensor, name: str = ""):
        self.name = name or f"copy-{uuid.uuid4().hex[:12]}"
        self.layout = KVPoolLayout.of_pool(pool)
        self.pool = pool
        self._connected: set[str] = set()
        self._notif_handler: NotifHandler | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="flotilla-kv-copy", daemon=True)
        self._thread.start()
        with _registry_lock:
            _registry[self.name] = self

    def local_info(self) -> PeerInfo:
        return PeerInfo(self.name, b"", self.layout)

    def is_connected(self, agent_name: str) -> bool:
        return agent_name in self._connected

    def connect(self, peer: PeerInfo) -> None:
        with _registry_lock:
            if peer.agent_name not in _registry:
                raise KVTransferError(f"no in-process peer named {peer.agent_name}")
        if not self.layout.compatible_with(peer.layout):
            raise KVTransferError(f"peer {peer.agent_name} has an incompatible KV layout")
        self._connected.add(peer.agent_name)

    def write_layer(
        self, agent_name: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], notif: bytes
    ) -> WriteTicket:
        ticket = WriteTicket.for_layer(src_block_ids, dst_block_ids, self.layout.block_bytes)
        self._jobs.put((agent_name, layer, list(src_block_ids), list(dst_block_ids), notif, ticket))
        return ticket

    def set_notif_handler(self, handler: NotifHandler) -> None:
        self._notif_handler = handler

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        with _registry_lock:
            _registry.pop(self.name, None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._carry_out(*job)

    def _carry_out(self, agent_name: str, layer: int, src: list[int], dst: list[int], notif: bytes,
                   ticket: WriteTicket) -> None:  # fmt: skip
        with _registry_lock:
            peer = _registry.get(agent_name)
        if peer is None or agent_name not in self._connected:
            ticket.finish(f"peer {agent_name} is gone")
            return
        src_ids = torch.tensor(src, dtype=torch.int64, device=self.pool.device)
        dst_ids = torch.tensor(dst, dtype=torch.int64, device=peer.pool.device)
        peer.pool[layer][:, dst_ids] = self.pool[layer][:, src_ids].to(peer.pool.device)
        ticket.finish()
        handler = peer._notif_handler
        if handler is not None:
            handler(self.name, notif)
