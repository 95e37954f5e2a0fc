"""Deficit round robin between tenants inside one class: shares in tokens, weights, stable peek."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flotilla.router.fair_queue import FairQueue


@dataclass(eq=False)
class Item:
    tenant: str
    cost: int
    weight: int = 1
    name: str = ""


def drain(queue: FairQueue) -> list[Item]:
    out = []
    while len(queue):
        assert queue.peek() is queue.peek()  # stable until popped
        out.append(queue.pop())
    return out


def test_a_flood_does_not_starve_a_quiet_tenant():
    queue = FairQueue(quantum_tokens=100)
    for i in range(500):
        queue.push(Item("A", 100, name=f"a{i}"))
    queue.push(Item("B", 100, name="b0"))
    order = [item.name for item in drain(queue)]
    assert order.index("b0") <= 2  # FIFO would put it at 500


def test_shares_are_in_tokens_not_requests():
    queue = FairQueue(quantum_tokens=100)
    for _ in range(40):
        queue.push(Item("big", 400))
    for _ in range(160):
        queue.push(Item("small", 100))
    first = drain(queue)[:100]
    tokens = {"big": 0, "small": 0}
    for item in first:
        tokens[item.tenant] += item.cost
    assert tokens["small"] == pytest.approx(tokens["big"], rel=0.1)


def test_weights_split_tokens_in_proportion():
    queue = FairQueue(quantum_tokens=50)
    for _ in range(200):
        queue.push(Item("paid", 50, weight=4))
        queue.push(Item("free", 50, weight=1))
    first = drain(queue)[:100]
    assert sum(item.tenant == "paid" for item in first) == 80


def test_discard_and_accounting():
    queue = FairQueue(quantum_tokens=10)
    items = [Item("A", 5), Item("A", 7), Item("B", 3)]
    for item in items:
        queue.push(item)
    assert len(queue) == 3 and queue.num_tokens == 15
    assert queue.discard(items[0]) and not queue.discard(items[0])
    assert queue.num_tokens == 10
    assert drain(queue) == [items[1], items[2]]
    assert queue.peek() is None and queue.num_tokens == 0
    with pytest.raises(IndexError):
        queue.pop()


def test_an_idle_tenant_banks_no_credit():
    queue = FairQueue(quantum_tokens=100)
    queue.push(Item("B", 10))
    assert queue.pop().tenant == "B"  # B leaves with 90 credit, which it must not keep
    for _ in range(3):
        queue.push(Item("A", 100))
    queue.push(Item("B", 100))
    queue.push(Item("B", 100))
    assert [item.tenant for item in drain(queue)] == ["A", "B", "A", "B", "A"]
