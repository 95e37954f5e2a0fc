"""Receiving side: check and count the per-layer write notifications of each transfer, and wake whoever waits
for all of them.

Messages are b"<transfer_id>:<layer>:<blocks>", blocks being the write's destination block ids as ranges
("3-7,9"). The decode side opens a transfer with the blocks it reserved for it before any peer learns its id;
a notification counts only for an open transfer, and is checked: its layer inside the pool, every block it
names reserved for that transfer, all of one transfer's from one agent (`check` compares it with the agent the
prefill worker says it is). A failing one marks the transfer violated and wakes its waiter: the decode side
fails the hand-off and quarantines the blocks. One for no open transfer (a late one of an ended transfer, a
peer guessing ids) is dropped and counted, never creates state.

What this cannot do: NIXL writes are one-sided (the receiver's NIC places the bytes; no code of the receiver
runs per write), so a peer that holds the pool's metadata can write anywhere in the registered pool and lie in
its notifications. The checks catch a sender that reports honestly what it did (a bug, a stale target) and
keep forged or stray notifications from completing a transfer; the metadata goes only to a peer of a hand-off
in flight (kv_service.GetTransferInfo).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def encode_blocks(block_ids: Sequence[int]) -> str:
    """Ascending runs as ranges: [3, 4, 5, 9] -> "3-5,9" (reserved blocks are mostly consecutive)."""
    parts: list[str] = []
    index = 0
    while index < len(block_ids):
        start = end = block_ids[index]
        while index + 1 < len(block_ids) and block_ids[index + 1] == end + 1:
            index += 1
            end += 1
        parts.append(str(start) if start == end else f"{start}-{end}")
        index += 1
    return ",".join(parts)


def notif_message(transfer_id: str, layer: int, dst_block_ids: Sequence[int] = ()) -> bytes:
    return f"{transfer_id}:{layer}:{encode_blocks(dst_block_ids)}".encode()


def _blocks_outside(text: str, allowed: frozenset[int]) -> str | None:
    """None when every block `text` names is in `allowed`; else what is wrong. Never expands a range larger
    than the allowed set (a forged "0-4000000000" costs nothing)."""
    if not text:
        return "names no block"
    for part in text.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return f"malformed blocks {text[:64]!r}"
        start, end = int(low), int(high or low)
        if end < start or end - start + 1 > len(allowed):
            return f"blocks {part} are not all reserved for it"
        if any(block_id not in allowed for block_id in range(start, end + 1)):
            return f"blocks {part} are not all reserved for it"
    return None


@dataclass
class _Transfer:
    allowed_blocks: frozenset[int]
    num_arrived: int = 0
    num_expected: int | None = None
    agents: set[str] = field(default_factory=set)
    violation: str | None = None
    waiter: asyncio.Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None


class ArrivalTracker:
    def __init__(self, num_layers: int | None = None):
        self._num_layers = num_layers
        self._lock = threading.Lock()
        self._transfers: dict[str, _Transfer] = {}
        self.num_refused = 0  # notifications dropped (no open transfer) or refused (failed a check)

    def open(self, transfer_id: str, block_ids: Iterable[int]) -> None:
        """Loop side, before the prefill worker learns the id: the blocks its writes may name."""
        with self._lock:
            self._transfers[transfer_id] = _Transfer(frozenset(block_ids))

    def on_notif(self, agent_name: str, message: bytes) -> None:
        """Transport thread: one write landed."""
        transfer_id, _, rest = message.decode(errors="replace").partition(":")
        layer, _, blocks = rest.partition(":")
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                self.num_refused += 1
                return
            problem = self._problem(transfer, agent_name, layer, blocks)
            if problem is not None:
                self.num_refused += 1
                transfer.violation = transfer.violation or f"a notification from {agent_name} {problem}"
            else:
                transfer.num_arrived += 1
                transfer.agents.add(agent_name)
            self._maybe_wake(transfer)

    def expect(self, transfer_id: str, num_writes: int) -> asyncio.Future[None]:
        """Loop side: a future that completes once `num_writes` notifications arrived for the open transfer
        (or one of them failed a check)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                raise KeyError(f"transfer {transfer_id} is not open")
            transfer.num_expected = num_writes
            transfer.loop = loop
            waiter = transfer.waiter = loop.create_future()
            self._maybe_wake(transfer)  # every write may have landed already
            return waiter

    def check(self, transfer_id: str, agent_name: str) -> str | None:
        """None when every counted notification was in order and came from `agent_name`; else why not."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                return "the transfer is not open"
            if transfer.violation is not None:
                return transfer.violation
            strangers = transfer.agents - {agent_name}
            if strangers:
                return f"notifications from {sorted(strangers)}, not from the prefill worker's agent {agent_name}"
            return None

    def num_arrived(self, transfer_id: str) -> int:
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            return transfer.num_arrived if transfer else 0

    def forget(self, transfer_id: str) -> None:
        """The transfer ended: its late notifications are dropped."""
        with self._lock:
            self._transfers.pop(transfer_id, None)

    def _problem(self, transfer: _Transfer, agent_name: str, layer: str, blocks: str) -> str | None:
        if not layer.isdigit() or (self._num_layers is not None and int(layer) >= self._num_layers):
            return f"names layer {layer[:16]!r}"
        outside = _blocks_outside(blocks, transfer.allowed_blocks)
        if outside is not None:
            return outside
        if transfer.agents and agent_name not in transfer.agents:
            return "comes from a second agent"
        return None

    def _maybe_wake(self, transfer: _Transfer) -> None:
        if transfer.waiter is None or transfer.num_expected is None or transfer.loop is None:
            return
        if transfer.violation is not None or transfer.num_arrived >= transfer.num_expected:
            waiter, transfer.waiter = transfer.waiter, None
            transfer.loop.call_soon_threadsafe(_resolve, waiter)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
