"""Every load report of a worker with the KV hand-off counts the hand-offs in flight, both directions: a
draining worker is stopped only once none is left (flotilla.autoscaling.drain)."""

from __future__ import annotations

from types import SimpleNamespace

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.worker.kv_wiring import KVWiring
from flotilla.worker.prefix_report import PrefixReporter


def test_load_report_counts_incoming_and_outgoing_hand_offs():
    handoff = SimpleNamespace(incoming={"t-in": object()}, outgoing={"t-out-1": "decode-a", "t-out-2": "decode-b"})
    wiring = KVWiring(handoff, PrefixReporter(engine=None))
    assert wiring.decorate(pb.LoadReport(num_running=1)).num_kv_handoffs == 3
    handoff.incoming.clear()
    handoff.outgoing.clear()
    assert wiring.decorate(pb.LoadReport()).num_kv_handoffs == 0
    assert KVWiring(None, PrefixReporter(engine=None)).decorate(pb.LoadReport()).num_kv_handoffs == 0  # role both
