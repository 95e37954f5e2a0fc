"""GB/s of one KV hand-off's worth of blocks: raw NIXL (one descriptor over the whole region), the fleet's
path (NixlTransport.write_layer, block descriptors, one write per layer), and a copy inside one process."""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import numpy as np
import torch

from flotilla.kv_transfer.copy_transport import CopyTransport
from flotilla.kv_transfer.nixl_transport import NixlTransport
from flotilla.kv_transfer.transport import wait_all
from loadtest.kv_transfer.sink import Sink


class Bandwidth(NamedTuple):
    raw_nixl_gbps: float
    fleet_nixl_gbps: float  # until every write completed (what the prefill side waits for)
    fleet_notified_gbps: float  # until the receiving process has seen every per-layer notification
    in_process_copy_gbps: float
    num_bytes: int


def measure(shape: tuple[int, ...], num_blocks: int, reps: int) -> Bandwidth:
    num_layers = shape[0]
    source = torch.randn(shape)
    sink = Sink(shape)
    try:
        fleet = NixlTransport(source, "bench-source")
        fleet.connect(sink.info)
        blocks = list(range(num_blocks))
        num_bytes = num_layers * 2 * num_blocks * fleet.layout.block_bytes

        written: list[float] = []

        def fleet_once(tag: str) -> None:
            started = time.perf_counter()
            tickets = [fleet.write_layer(sink.info.agent_name, layer, blocks, blocks, f"{tag}:{layer}".encode())
                       for layer in range(num_layers)]  # fmt: skip
            wait_all(tickets, 60)
            written.append(time.perf_counter() - started)
            sink.wait_notifs(tag + ":", num_layers)

        fleet_s = _best(lambda i: fleet_once(f"f{i}"), reps)
        write_s = statistics.median(written[1:])
        fleet.close()
        raw_s = _raw_nixl(source, sink, num_bytes, reps)
    finally:
        sink.close()
    copy_s = _in_process_copy(shape, blocks, reps)
    return Bandwidth(num_bytes / raw_s / 1e9, num_bytes / write_s / 1e9, num_bytes / fleet_s / 1e9,
                     num_bytes / copy_s / 1e9, num_bytes)  # fmt: skip


def _best(fn, reps: int) -> float:
    times = []
    for i in range(reps + 1):  # the first one warms up connections
        started = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _raw_nixl(source: torch.Tensor, sink: Sink, num_bytes: int, reps: int) -> float:
    """The same number of bytes as one contiguous write (the ceiling for this pair of processes)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-raw", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory(source)
    remote = agent.add_remote_agent(sink.info.metadata)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[source.data_ptr(), num_bytes, 0]], dtype=np.uint64),
                                  "DRAM")  # fmt: skip
    far = agent.prep_xfer_dlist(remote, np.array([[sink.info.layout.base_address, num_bytes, 0]], dtype=np.uint64),
                                "DRAM")  # fmt: skip

    def once(i: int) -> None:
        handle = agent.make_prepped_xfer("WRITE", local, [0], far, [0], f"raw{i}".encode())
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL write failed: {state}")
        handle.release()
        sink.wait_notifs(f"raw{i}", 1)

    return _best(once, reps)


def _in_process_copy(shape: tuple[int, ...], blocks: list[int], reps: int) -> float:
    a, b = CopyTransport(torch.randn(shape)), CopyTransport(torch.zeros(shape))
    b.set_notif_handler(lambda *_: None)
    a.connect(b.local_info())
    try:
        return _best(lambda i: wait_all([a.write_layer(b.name, layer, blocks, blocks, b"c")
                                         for layer in range(shape[0])], 60), reps)  # fmt: skip
    finally:
        a.close()
        b.close()
