"""KV transfer over NIXL (UCX backend): host memory between processes here, GPU memory over RDMA/NVLink on a
cluster, with the same calls.

One thread owns the NIXL agent and makes every call into it: it posts queued writes, polls their state,
and collects notifications. The agent runs without NIXL's own progress thread (that one busy-spins a core);
ours sleeps briefly between polls. Posting (`transfer()`) copies synchronously for host memory, which is
why it happens on this thread and not on the engine thread: the engine computes the next layer meanwhile.
The whole KV pool is registered once; each peer's descriptors are prepared once and cached.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flotilla.kv_transfer.layout import KVPoolLayout, PeerInfo
from flotilla.kv_transfer.transport import KVTransferError, KVTransport, NotifHandler, WriteTicket

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.001  # nothing in flight: how long the thread sleeps between looks at notifications
BUSY_POLL_S = 0.0001  # writes in flight


def _set_env_defaults() -> None:
    # Before the first import of nixl: UCX reads its environment when the backend starts.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


@dataclass
class _Peer:
    name: str
    layout: KVPoolLayout
    remote_dlist: Any


@dataclass
class _Write:
    peer: str
    layer: int
    src: list[int]
    dst: list[int]
    notif: bytes
    ticket: WriteTicket


class NixlTransport(KVTransport):
    def __init__(self, pool: torch.Tensor, name: str = ""):
        _set_env_defaults()
        self.name = name or f"kv-{uuid.uuid4().hex[:12]}"
        self.layout = KVPoolLayout.of_pool(pool)
        self._pool = pool  # keep the registered memory alive
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._peers: dict[str, _Peer] = {}  # touched on the NIXL thread only
        self._connected: set[str] = set()  # read from any thread
        self._in_flight: list[tuple[Any, WriteTicket]] = []
        self._notif_handler: NotifHandler | None = None
        self._stopping = False
        ready: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="flotilla-nixl", daemon=True)
        self._thread.start()
        self._metadata = ready.result(timeout=60)

    # ---- interface -----------------------------------------------------------------------------
    def local_info(self) -> PeerInfo:
        return PeerInfo(self.name, self._metadata, self.layout)

    def is_connected(self, agent_name: str) -> bool:
        return agent_name in self._connected

    def connect(self, peer: PeerInfo) -> None:
        if peer.agent_name in self._connected:
            return
        if not self.layout.compatible_with(peer.layout):
            raise KVTransferError(f"peer {peer.agent_name} has an incompatible KV layout: {peer.layout}")
        self._call(lambda: self._add_peer(peer), timeout_s=30)
        self._connected.add(peer.agent_name)

    def write_layer(
        self, agent_name: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], notif: bytes
    ) -> WriteTicket:
        ticket = WriteTicket.for_layer(src_block_ids, dst_block_ids, self.layout.block_bytes)
        write = _Write(agent_name, layer, list(src_block_ids), list(dst_block_ids), notif, ticket)
        self._commands.put(lambda: self._post(write))
        return ticket

    def set_notif_handler(self, handler: NotifHandler) -> None:
        self._notif_handler = handler

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=10)

    # ---- the NIXL thread ------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

        self._commands.put(run)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise KVTransferError(f"NIXL call did not finish in {timeout_s:.0f} s") from None

    def _run(self, ready: concurrent.futures.Future[bytes]) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            self._agent.register_memory(self._pool)
            self._local_dlist = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self.layout.descriptors(), self.layout.mem_type
            )
            ready.set_result(self._agent.get_agent_metadata())
        except BaseException as exc:
            ready.set_exception(exc)
            return
        while not self._stopping:
            worked = self._drain_commands()
            worked |= self._poll_in_flight()
            worked |= self._poll_notifs()
            if not worked:
                time.sleep(BUSY_POLL_S if self._in_flight else IDLE_POLL_S)
        for _, ticket in self._in_flight:
            ticket.finish("transport closed")

    def _drain_commands(self) -> bool:
        worked = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return worked
            command()
            worked = True

    def _add_peer(self, info: PeerInfo) -> None:
        name = self._agent.add_remote_agent(info.metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != info.agent_name:
            raise KVTransferError(f"metadata names agent {name!r}, expected {info.agent_name!r}")
        dlist = self._agent.prep_xfer_dlist(name, info.layout.descriptors(), info.layout.mem_type)
        self._peers[name] = _Peer(name, info.layout, dlist)

    def _post(self, write: _Write) -> None:
        peer = self._peers.get(write.peer)
        if peer is None:
            write.ticket.finish(f"not connected to {write.peer}")
            return
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                self._local_dlist,
                self.layout.layer_indices(write.layer, write.src),
                peer.remote_dlist,
                peer.layout.layer_indices(write.layer, write.dst),
                write.notif,
            )
            state = self._agent.transfer(handle)
        except Exception as exc:  # nixlBackendError etc.: a dead peer shows up here
            write.ticket.finish(f"write to {write.peer} failed: {exc}")
            return
        self._settle(handle, state, write.ticket)

    def _settle(self, handle: Any, state: str, ticket: WriteTicket) -> None:
        if state == "PROC":
            self._in_flight.append((handle, ticket))
            return
        handle.release()
        ticket.finish(None if state == "DONE" else f"write failed ({state})")

    def _poll_in_flight(self) -> bool:
        if not self._in_flight:
            return False
        pending, self._in_flight = self._in_flight, []
        for handle, ticket in pending:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:
                state = f"ERR {exc}"
            self._settle(handle, state, ticket)
        return len(self._in_flight) < len(pending)

    def _poll_notifs(self) -> bool:
        notifs = self._agent.get_new_notifs()
        if not notifs:
            return False
        handler = self._notif_handler
        for agent_name, messages in notifs.items():
            for message in messages:
                if handler is not None:
                    try:
                        handler(agent_name, message)
                    except Exception:
                        logger.exception("KV notification handler failed on %r", message)
        return True
