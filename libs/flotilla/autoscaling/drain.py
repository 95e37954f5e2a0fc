"""When a draining worker may stop: it holds no stream, no queued or running request and no KV hand-off, by
the router's own count of the streams it relays and by the worker's load report (which also sees hand-offs
the router does not relay: a prefill worker sending a prompt's KV to a decode worker)."""

from __future__ import annotations

from flotilla.api.router.v1 import router_pb2 as rpb


def holds_work(status: rpb.WorkerStatus) -> bool:
    load = status.load
    return bool(status.num_inflight or load.num_running or load.num_waiting or load.num_kv_handoffs)


def drain_finished(status: rpb.WorkerStatus) -> bool:
    """Draining, and idle by a load report the worker sent after the drain began (an older report may
    predate a hand-off that was planned just before it)."""
    return (status.state == rpb.WORKER_STATE_DRAINING and not holds_work(status)
            and status.seconds_since_heartbeat < status.seconds_in_state)
