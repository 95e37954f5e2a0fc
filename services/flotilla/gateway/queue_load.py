"""The router's queue load as the gateway sees it: a cheap periodic signal, not a call per request.

A background task asks the router (GetQueueLoad) every `interval_s` for the interactive backlog (as a wait) of the
models this gateway served lately. Admission reads the last answer without waiting (degradation.py). An
answer older than `stale_after_s` (the router unreachable, or a router without GetQueueLoad) reads as no
signal: nothing is degraded, and the router's own wait budgets still shed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc

from flotilla.api.router.v1 import router_pb2

log = logging.getLogger(__name__)

Fetch = Callable[[Sequence[str]], Awaitable[router_pb2.GetQueueLoadResponse]]
FORGET_AFTER_S = 60.0  # a model nobody asked for in this long is no longer polled


def queue_load_signal(settings, backend) -> QueueLoad | None:
    """The poller for a gateway's settings (GatewaySettings) and router backend; None when degradation is off
    or the backend cannot say (an in-process fake)."""
    fetch = getattr(backend, "queue_load", None)
    if not settings.degradation.enabled or fetch is None:
        return None
    return QueueLoad(fetch, settings.degradation.poll_interval_s)


class QueueLoad:
    def __init__(self, fetch: Fetch, interval_s: float = 0.5, stale_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._fetch = fetch
        self.interval_s = interval_s
        self._stale_after_s = 4 * interval_s if stale_after_s is None else stale_after_s
        self._clock = clock
        self._wanted: dict[str, float] = {}  # model -> when a request last asked for it
        self._waits: dict[str, tuple[float, float]] = {}  # model -> (estimated wait, when it was read)

    def wait_s(self, model: str) -> float | None:
        """The model's last estimated interactive wait; None when unknown or stale. Marks it as wanted."""
        now = self._clock()
        self._wanted[model] = now
        known = self._waits.get(model)
        if known is None or now - known[1] > self._stale_after_s:
            return None
        return known[0]

    async def poll_once(self) -> None:
        now = self._clock()
        self._wanted = {m: t for m, t in self._wanted.items() if now - t <= FORGET_AFTER_S}
        if not self._wanted:
            return
        response = await self._fetch(sorted(self._wanted))
        read_at = self._clock()
        for load in response.models:
            if load.HasField("interactive_wait_s"):
                self._waits[load.model] = (load.interactive_wait_s, read_at)
            else:
                self._waits.pop(load.model, None)

    async def run_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except grpc.RpcError as err:  # logged once per kind, not every poll
                log.debug("queue load poll failed: %s", err.code() if hasattr(err, "code") else err)
            except Exception:
                log.exception("queue load poll failed")
            await asyncio.sleep(self.interval_s)
