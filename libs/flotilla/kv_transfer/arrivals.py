"""Receiving side: count per-layer write notifications per transfer and wake whoever waits for all of them.

Messages are b"<transfer_id>:<layer>". The sender reports how many writes it made (layers x chunks) once its
prefill is done; the transfer is complete when that many notifications arrived. Notifications may arrive
before anyone waits, so counts are kept until `forget()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field

MAX_FORGOTTEN = 4096  # recently forgotten transfers whose late notifications are dropped


def notif_message(transfer_id: str, layer: int) -> bytes:
    return f"{transfer_id}:{layer}".encode()


@dataclass
class _Transfer:
    num_arrived: int = 0
    num_expected: int | None = None
    layers: set[int] = field(default_factory=set)
    waiter: asyncio.Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None


class ArrivalTracker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: dict[str, _Transfer] = {}
        # An aborted transfer's last writes may still notify after forget(): drop those, do not re-create it.
        self._forgotten: set[str] = set()
        self._forgotten_order: deque[str] = deque()

    def on_notif(self, agent_name: str, message: bytes) -> None:
        """Transport thread: one write landed."""
        transfer_id, _, layer = message.decode(errors="replace").rpartition(":")
        with self._lock:
            if transfer_id in self._forgotten:
                return
            transfer = self._transfers.setdefault(transfer_id, _Transfer())
            transfer.num_arrived += 1
            if layer.isdigit():
                transfer.layers.add(int(layer))
            self._maybe_wake(transfer)

    def expect(self, transfer_id: str, num_writes: int) -> asyncio.Future[None]:
        """Loop side: a future that completes once `num_writes` notifications arrived for the transfer."""
        loop = asyncio.get_running_loop()
        with self._lock:
            transfer = self._transfers.setdefault(transfer_id, _Transfer())
            transfer.num_expected = num_writes
            transfer.loop = loop
            waiter = transfer.waiter = loop.create_future()
            self._maybe_wake(transfer)  # every write may have landed already
            return waiter

    def num_arrived(self, transfer_id: str) -> int:
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            return transfer.num_arrived if transfer else 0

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._transfers.pop(transfer_id, None)
            self._forgotten.add(transfer_id)
            self._forgotten_order.append(transfer_id)
            if len(self._forgotten_order) > MAX_FORGOTTEN:
                self._forgotten.discard(self._forgotten_order.popleft())

    def _maybe_wake(self, transfer: _Transfer) -> None:
        if transfer.waiter is None or transfer.num_expected is None or transfer.loop is None:
            return
        if transfer.num_arrived >= transfer.num_expected:
            waiter, transfer.waiter = transfer.waiter, None
            transfer.loop.call_soon_threadsafe(_resolve, waiter)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
