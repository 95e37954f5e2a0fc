"""A receiving worker's KV pool in its own process: registered with NIXL, every notification forwarded
(with its arrival time on the shared monotonic clock) to the benchmark process."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch


def run_sink(shape: tuple[int, ...], info_queue, notif_queue, stop) -> None:
    torch.set_num_threads(1)
    from flotilla.kv_transfer.nixl_transport import NixlTransport

    transport = NixlTransport(torch.zeros(shape, dtype=torch.float32), "bench-sink")
    transport.set_notif_handler(lambda agent, message: notif_queue.put((message.decode(), time.monotonic())))
    info_queue.put(transport.local_info())
    stop.wait()
    transport.close()


class Sink:
    def __init__(self, shape: tuple[int, ...]):
        ctx = mp.get_context("spawn")
        self._info, self.notifs, self._stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self._process = ctx.Process(target=run_sink, args=(shape, self._info, self.notifs, self._stop), daemon=True)
        self._process.start()
        self.info = self._info.get(timeout=120)

    def wait_notifs(self, prefix: str, count: int, timeout_s: float = 120.0) -> float:
        """Arrival time of the count-th notification whose message starts with `prefix`."""
        seen, last, deadline = 0, 0.0, time.monotonic() + timeout_s
        while seen < count:
            message, arrived = self.notifs.get(timeout=max(0.001, deadline - time.monotonic()))
            if message.startswith(prefix):
                seen, last = seen + 1, max(last, arrived)
        return last

    def close(self) -> None:
        self._stop.set()
        self._process.join(timeout=30)
