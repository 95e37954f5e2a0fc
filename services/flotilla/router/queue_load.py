"""GetQueueLoad, pure over admission: each asked model's interactive backlog as a wait (Admission.backlog_wait_s).

Gateways poll it to degrade free-tier requests (smaller max_tokens, tighter token quotas) while the queue
grows, before the wait budgets make the router shed them (gateway/degradation.py). The backlog wait (every
tenant's queued tokens / measured throughput) bounds from above the estimate the wait-budget check makes for
any one request, so a free request is degraded before, never after, its own estimate could shed it.
"""

from __future__ import annotations

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission

MAX_MODELS = 256  # per call: a gateway asks for the models it served lately


def queue_load(request: rpb.GetQueueLoadRequest, admission: Admission) -> rpb.GetQueueLoadResponse:
    response = rpb.GetQueueLoadResponse()
    for name in list(dict.fromkeys(request.models))[:MAX_MODELS]:
        load = response.models.add(model=name, num_queued_requests=admission.queue_depth(name))
        wait_s = admission.backlog_wait_s(name, pb.PRIORITY_CLASS_INTERACTIVE)
        if wait_s is not None:
            load.interactive_wait_s = wait_s
    return response
