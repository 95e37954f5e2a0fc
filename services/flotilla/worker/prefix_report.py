"""Reports the prefix cache's block hashes with every load report, for the router's prefix affinity.

The hash table lives on the engine thread, so a copy is taken there (between steps) every interval and the
heartbeat reads the copy. Newest blocks last; capped, so a heartbeat stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.engine.async_engine import AsyncEngine, EngineDeadError
from flotilla.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

MAX_REPORTED_HASHES = 4096


def _cached_hashes(engine: LLMEngine) -> list[bytes]:
    return list(engine.kv_cache_manager.pool.cached)[-MAX_REPORTED_HASHES:]


class PrefixReporter:
    def __init__(self, engine: AsyncEngine, interval_s: float = 0.25):
        self._engine = engine
        self._interval_s = interval_s
        self._hashes: list[bytes] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def decorate(self, report: pb.LoadReport) -> pb.LoadReport:
        report.cached_block_hashes.extend(self._hashes)
        return report

    async def refresh(self) -> None:
        self._hashes = await self._engine.call(_cached_hashes)

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except EngineDeadError:
                return
            except Exception:
                logger.exception("reading the prefix cache's hashes failed")
            await asyncio.sleep(self._interval_s)  # a periodic timer, not a wait for something
