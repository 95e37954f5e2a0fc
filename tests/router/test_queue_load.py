"""GetQueueLoad: the interactive backlog as a wait, every tenant's, bounding any one request's estimate."""

from __future__ import annotations

import asyncio

import pytest

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Ticket
from flotilla.router.queue_load import queue_load

from tests.router.test_router_queues import make, report, settle


async def test_the_backlog_wait_counts_every_tenant_and_bounds_a_request_estimate():
    registry, admission, clock = make()
    cold = queue_load(rpb.GetQueueLoadRequest(models=["tiny", "other"]), admission)
    assert [(m.model, m.HasField("interactive_wait_s")) for m in cold.models] == [("tiny", False), ("other", False)]
    report(registry, clock, running=1, total_tokens=0, admission=admission)
    report(registry, clock, running=0, total_tokens=100, admission=admission)  # 100 tokens/s measured
    await admission.acquire("tiny", 10)  # the only slot
    waiting = [asyncio.create_task(admission.acquire("tiny", 50, ticket=Ticket(tenant=t, num_tokens=100)))
               for t in ("A", "A", "A", "B")]
    await settle()
    (load,) = queue_load(rpb.GetQueueLoadRequest(models=["tiny", "tiny"]), admission).models
    assert load.num_queued_requests == 4
    assert load.interactive_wait_s == pytest.approx(4.1)  # 4 x 100 queued + 10 placed, at 100 tokens/s
    assert admission.estimated_wait_s("tiny", Ticket(tenant="C", num_tokens=100)) < load.interactive_wait_s
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
