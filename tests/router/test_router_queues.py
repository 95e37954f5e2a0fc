"""Router admission with classes and tenants: interactive before batch, fairness inside a class, the
wait-budget check (OVERLOADED with retry_after_s), deadlines rejected at the head, bounded depth."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission, RouterError, Ticket
from flotilla.router.placement import PlacementLimits
from flotilla.router.registry import WorkerRegistry

INTERACTIVE, BATCH = pb.PRIORITY_CLASS_INTERACTIVE, pb.PRIORITY_CLASS_BATCH


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(max_requests=1, max_queue_depth=64):
    clock = Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=1e9, clock=clock,
                              channel_factory=lambda address: grpc.aio.insecure_channel(address))
    admission = Admission(registry, {}, ("tiny",), PlacementLimits(1_000_000, max_requests), max_queue_depth,
                          30.0, wall_clock=clock)
    model = pb.ModelInfo(name="tiny", version="v1", max_model_len=2048)
    registry.register(rpb.WorkerInfo(worker_id="w", address="127.0.0.1:9", model=model))
    return registry, admission, clock


def report(registry, clock, running: int, total_tokens: int, dt: float = 1.0, admission=None) -> None:
    """A heartbeat; like the service, follow it with dispatch() (which also samples throughput)."""
    clock.now += dt
    registry.heartbeat("w", pb.LoadReport(num_running=running, num_output_tokens_total=total_tokens,
                                          num_total_blocks=64, num_free_blocks=64, block_size=16))
    if admission is not None:
        admission.dispatch()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_interactive_before_batch_and_fair_between_tenants():
    registry, admission, clock = make()
    report(registry, clock, running=0, total_tokens=0)
    first = await admission.acquire("tiny", 10, ticket=Ticket(tenant="A", num_tokens=100))  # takes the only slot
    assert first.worker.worker_id == "w"
    tasks = {}
    for i in range(20):
        tasks[f"a{i}"] = asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(tenant="A", num_tokens=100)))
    tasks["batch"] = asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(BATCH, "C", 100)))
    tasks["b"] = asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(tenant="B", num_tokens=100)))
    await settle()
    assert admission.queue_depth("tiny") == 22 and admission.queue_depth("tiny", BATCH) == 1
    order = []
    while len(order) < 22:
        registry.release(first.worker)  # the running request's relay ended: its slot frees up
        report(registry, clock, running=0, total_tokens=0)  # one more is placed
        admission.dispatch()
        await settle()
        done = [name for name, task in tasks.items() if task.done() and name not in order]
        assert len(done) == 1
        order += done
    assert order.index("b") <= 1 and order[-1] == "batch"


async def test_over_budget_is_refused_with_retry_after_and_batch_sheds_first():
    registry, admission, clock = make()
    report(registry, clock, running=1, total_tokens=0, admission=admission)
    report(registry, clock, running=0, total_tokens=100, admission=admission)  # measured while busy: 100 tokens/s
    await admission.acquire("tiny", 10)  # the only slot
    waiting = [asyncio.create_task(admission.acquire("tiny", 50, ticket=Ticket(tenant="A", num_tokens=100)))
               for _ in range(3)]
    await settle()
    assert admission.estimated_wait_s("tiny", Ticket(tenant="A")) == pytest.approx(3.1)  # 3 x 100 queued + 10 placed
    # a quiet tenant waits behind about one round of A, not A's whole backlog
    assert admission.estimated_wait_s("tiny", Ticket(tenant="B", num_tokens=100)) == pytest.approx(1.1)
    with pytest.raises(RouterError) as refused:
        await admission.acquire("tiny", 50, ticket=Ticket(BATCH, "C", 100, max_queue_wait_s=1.0))
    assert refused.value.code == pb.ERROR_CODE_OVERLOADED and refused.value.retry_after_s == 3.0
    paid = asyncio.create_task(admission.acquire("tiny", 50, ticket=Ticket(tenant="P", num_tokens=100,
                                                                            max_queue_wait_s=30.0)))
    await settle()
    assert not paid.done() and admission.queue_depth("tiny") == 4
    for task in [*waiting, paid]:
        task.cancel()
    await asyncio.gather(*waiting, paid, return_exceptions=True)
    assert admission.queue_depth("tiny") == 0


async def test_unmeasured_throughput_sheds_nothing_and_depth_is_bounded():
    _, admission, _ = make(max_queue_depth=2)
    await admission.acquire("tiny", 10)
    waiting = [asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(max_queue_wait_s=0.001)))
               for _ in range(2)]
    await settle()
    assert not any(task.done() for task in waiting)
    with pytest.raises(RouterError) as full:
        await admission.acquire("tiny", 10)
    assert full.value.code == pb.ERROR_CODE_OVERLOADED and full.value.retry_after_s >= 1
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_deadline_passed_is_rejected_at_the_head():
    registry, admission, clock = make()
    first = await admission.acquire("tiny", 10)
    late = asyncio.create_task(admission.acquire("tiny", 10, deadline_unix_s=clock.now + 0.5))
    on_time = asyncio.create_task(admission.acquire("tiny", 10, deadline_unix_s=clock.now + 100))
    await settle()
    registry.release(first.worker)  # the first request's relay ended
    report(registry, clock, running=0, total_tokens=0, dt=1.0)  # past the first deadline, slot free
    admission.dispatch()
    await settle()
    with pytest.raises(RouterError) as missed:
        await late
    assert missed.value.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
    assert (await on_time).worker.worker_id == "w"


def test_ticket_from_a_request():
    request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=7),
                                 priority=BATCH, tenant_id="t", tenant_weight=0, max_queue_wait_s=2.5)
    assert Ticket.of(request) == Ticket(BATCH, "t", 10, 1, 2.5)
    assert Ticket.of(pb.GenerateRequest()).priority == INTERACTIVE


async def test_paid_sheds_in_proportion_to_each_tenants_backlog():
    # One class, one wait budget: a tenant's estimated wait counts its own backlog and only a round of the
    # others', so the tenant that floods is refused while a light tenant of the same tier still queues.
    registry, admission, clock = make()
    report(registry, clock, running=1, total_tokens=0, admission=admission)
    report(registry, clock, running=0, total_tokens=100, admission=admission)  # 100 tokens/s
    await admission.acquire("tiny", 10)  # the only slot
    heavy = [asyncio.create_task(admission.acquire("tiny", 50, ticket=Ticket(tenant="A", num_tokens=100)))
             for _ in range(5)]
    await settle()
    with pytest.raises(RouterError) as refused:
        await admission.acquire("tiny", 50, ticket=Ticket(tenant="A", num_tokens=100, max_queue_wait_s=2.0))
    assert refused.value.code == pb.ERROR_CODE_OVERLOADED and refused.value.retry_after_s >= 1
    light = asyncio.create_task(admission.acquire("tiny", 50, ticket=Ticket(tenant="B", num_tokens=100,
                                                                             max_queue_wait_s=2.0)))
    await settle()
    assert not light.done() and admission.queue_depth("tiny") == 6  # queued, not refused
    for task in [*heavy, light]:
        task.cancel()
    await asyncio.gather(*heavy, light, return_exceptions=True)


async def test_a_tenant_with_nothing_in_flight_starts_at_once_in_the_extra_slot():
    clock = Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=1e9, clock=clock,
                              channel_factory=lambda address: grpc.aio.insecure_channel(address))
    admission = Admission(registry, {}, ("tiny",), PlacementLimits(1_000_000, 1, idle_tenant_extra_slots=1), 64,
                          30.0, wall_clock=clock)
    registry.register(rpb.WorkerInfo(worker_id="w", address="127.0.0.1:9",
                                     model=pb.ModelInfo(name="tiny", version="v1", max_model_len=2048)))
    report(registry, clock, running=0, total_tokens=0)
    a_first = await admission.acquire("tiny", 10, ticket=Ticket(tenant="A", num_tokens=100))  # the only slot
    a_queued = [asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(tenant="A", num_tokens=100)))
                for _ in range(3)]
    await settle()
    b_first = await asyncio.wait_for(admission.acquire("tiny", 10, ticket=Ticket(tenant="B", num_tokens=100)), 1)
    assert b_first.worker.worker_id == "w"  # placed past A's backlog, in the extra slot
    b_second = asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(tenant="B", num_tokens=100)))
    c_first = asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(tenant="C", num_tokens=100)))
    batch = asyncio.create_task(admission.acquire("tiny", 10, ticket=Ticket(BATCH, "D", 100)))
    await settle()
    # B is no longer idle; C is, but the worker's one extra slot is taken; D's class waits behind interactive.
    assert not any(t.done() for t in (b_second, c_first, batch, *a_queued))
    assert admission.queue_depth("tiny") == 6
    registry.release(b_first.worker, "B")
    registry.release(a_first.worker, "A")
    assert registry.num_assigned_to_tenant("tiny", "A") == 0 and registry.num_assigned_to_tenant("tiny", "B") == 0
    for task in [*a_queued, b_second, c_first, batch]:
        task.cancel()
    await asyncio.gather(*a_queued, b_second, c_first, batch, return_exceptions=True)
