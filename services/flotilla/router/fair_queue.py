"""One priority class's queue: a FIFO per tenant, deficit round robin on tokens between tenants.

Each turn a tenant earns `quantum_tokens * weight` of credit and sends requests while its credit covers
the next one's cost (prompt + max_tokens); then the next tenant's turn. A tenant that floods the queue
thus gets its share of tokens, not of arrivals: one quiet tenant's request waits at most about one round.
A tenant whose queue empties loses its credit (classic DRR: no banking while idle).

Contract: `peek()` returns the request `pop()` will remove, and repeated peeks without a pop return the
same one; `discard` removes a request that gave up (timed out or cancelled) from anywhere.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

DEFAULT_QUANTUM_TOKENS = 32  # small: a quiet tenant waits for about one quantum (x weight) per busy tenant


class Fair(Protocol):
    tenant: str
    cost: int  # tokens of work: prompt + max_tokens
    weight: int  # >= 1


W = TypeVar("W", bound=Fair)


class FairQueue(Generic[W]):
    def __init__(self, quantum_tokens: int = DEFAULT_QUANTUM_TOKENS):
        if quantum_tokens < 1:
            raise ValueError(f"quantum_tokens must be >= 1, got {quantum_tokens}")
        self.quantum_tokens = quantum_tokens
        self._active: OrderedDict[str, deque[W]] = OrderedDict()  # round-robin order, front = current turn
        self._deficit: dict[str, int] = {}
        self._turn: str | None = None  # the front tenant once its turn's credit was granted
        self._len = 0
        self.num_tokens = 0  # cost of everything queued
        self._tenant_tokens: dict[str, int] = {}
        self._weights: dict[str, int] = {}

    def push(self, item: W) -> None:
        self._active.setdefault(item.tenant, deque()).append(item)
        self._deficit.setdefault(item.tenant, 0)
        self._len += 1
        self.num_tokens += item.cost
        self._tenant_tokens[item.tenant] = self._tenant_tokens.get(item.tenant, 0) + item.cost
        self._weights[item.tenant] = max(1, item.weight)

    def tokens_ahead(self, tenant: str, cost: int, weight: int) -> int:
        """Roughly the tokens served before a new request of `tenant` would finish waiting: its own
        queue, and from every other tenant at most its weighted share of the same amount (round robin)."""
        own = self._tenant_tokens.get(tenant, 0) + cost
        share = own / max(1, weight)
        others = sum(min(tokens, share * self._weights[t]) for t, tokens in self._tenant_tokens.items() if t != tenant)
        return int(own - cost + others)

    def peek(self) -> W | None:
        while self._active:
            tenant, queue = next(iter(self._active.items()))
            if self._turn != tenant:
                self._turn = tenant
                self._deficit[tenant] += self.quantum_tokens * max(1, queue[0].weight)
            if self._deficit[tenant] >= queue[0].cost:
                return queue[0]
            self._active.move_to_end(tenant)
            self._turn = None
        return None

    def pop(self) -> W:
        item = self.peek()
        if item is None:
            raise IndexError("pop from an empty FairQueue")
        self._deficit[item.tenant] -= item.cost
        self._remove(item.tenant, self._active[item.tenant].popleft())
        return item

    def discard(self, item: W) -> bool:
        queue = self._active.get(item.tenant)
        if queue is None:
            return False
        try:
            queue.remove(item)
        except ValueError:
            return False
        self._remove(item.tenant, item)
        return True

    def _remove(self, tenant: str, item: W) -> None:
        self._len -= 1
        self.num_tokens -= item.cost
        self._tenant_tokens[tenant] -= item.cost
        if not self._active[tenant]:
            del self._active[tenant]
            del self._deficit[tenant]
            del self._tenant_tokens[tenant]
            del self._weights[tenant]
            if self._turn == tenant:
                self._turn = None

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[W]:
        for queue in self._active.values():
            yield from queue
