"""The transport interface: write one layer's blocks into a peer's pool, with a notification per write.

Contract:
- `local_info()` is what a peer passes to `connect()`; a transport connects to each peer once and caches it.
- `write_layer()` posts and returns at once; the returned ticket completes when the bytes are in the peer's
  memory (or the write failed). Source blocks must stay untouched until then.
- The receiver's notification handler gets (peer agent name, message) for every completed write, after its
  bytes have landed, on the transport's own thread.
- A write into memory the peer has released is NOT detected: the caller's protocol owns buffer lifetimes.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from flotilla.kv_transfer.layout import PeerInfo

NotifHandler = Callable[[str, bytes], None]


class KVTransferError(RuntimeError):
    """A write failed (peer gone, bad descriptors) or did not complete in time."""


class WriteTicket:
    """Completion of one posted write; set from the transport thread."""

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes
        self.error: str | None = None
        self._done = threading.Event()

    @classmethod
    def for_layer(cls, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], block_bytes: int) -> WriteTicket:
        """The ticket of one layer's write: K and V of every block pair."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("src and dst block lists differ in length")
        return cls(2 * len(src_block_ids) * block_bytes)

    def finish(self, error: str | None = None) -> None:
        self.error = error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


def wait_all(tickets: Sequence[WriteTicket], timeout_s: float) -> None:
    """Block until every ticket completed; raise KVTransferError on the first failure or at the timeout."""
    deadline = _now() + timeout_s
    for ticket in tickets:
        if not ticket.wait(max(0.0, deadline - _now())):
            raise KVTransferError(f"write not complete after {timeout_s:.1f} s")
        if ticket.error is not None:
            raise KVTransferError(ticket.error)


def _now() -> float:
    import time

    return time.monotonic()


class KVTransport(ABC):
    name: str

    @abstractmethod
    def local_info(self) -> PeerInfo: ...

    @abstractmethod
    def connect(self, peer: PeerInfo) -> None:
        """Make the peer writable; idempotent (cached per agent name). Raises KVTransferError."""

    @abstractmethod
    def is_connected(self, agent_name: str) -> bool: ...

    @abstractmethod
    def write_layer(
        self, agent_name: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], notif: bytes
    ) -> WriteTicket:
        """Post a write of K and V of `src_block_ids` (local) into `dst_block_ids` (peer) for one layer."""

    @abstractmethod
    def set_notif_handler(self, handler: NotifHandler) -> None: ...

    @abstractmethod
    def close(self) -> None: ...
