"""A shared-pool worker's loaded models: at most `max_loaded` engines, in least-recently-used order.

`acquire(name)` returns the model's engine with a stream pinned on it, loading it first when needed (from the
local checkpoint directory; nothing is downloaded). Loads run one at a time. To make room a load unloads the
least recently used model that has no live stream; when every loaded model has streams it waits until one
drains (a model is never unloaded under a stream). Using a model (acquire) makes it the most recent.

Contract: every acquire is matched by one release; the LRU order and the pins only change on the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Served = TypeVar("Served")


class ModelLoadError(RuntimeError):
    """The model's engine could not be started (bad checkpoint, out of memory)."""


@dataclass(eq=False)
class LoadedModel(Generic[Served]):
    name: str
    served: Served
    num_streams: int = 0  # pinned by acquire, until release


@dataclass(frozen=True)
class LoadResult:
    loaded: tuple[str, ...]  # LRU first
    unloaded: tuple[str, ...]  # what this load unloaded
    load_seconds: float
    already_loaded: bool


@dataclass
class CacheCounters:
    num_loads: int = 0
    num_unloads: int = 0
    num_load_failures: int = 0
    unloaded: list[str] = field(default_factory=list)  # every unload in order (the last 64)


def choose_victim(lru_first: Sequence[tuple[str, int]]) -> str | None:
    """The least recently used model with no live stream; `lru_first` is (name, live streams), oldest first.
    None: every loaded model has streams (wait for one to drain)."""
    for name, num_streams in lru_first:
        if num_streams == 0:
            return name
    return None


class ModelCache(Generic[Served]):
    def __init__(self, max_loaded: int, start: Callable[[str], Awaitable[Served]],
                 stop: Callable[[Served], Awaitable[None]], on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, check: Callable[[str], None] = lambda name: None,
                 free_memory: Callable[[], None] = gc.collect):
        """`check(name)` raises for a model that cannot load (its checkpoint went bad, it does not fit): run
        before anything is unloaded for it. `free_memory` runs after an unload, once nothing here holds it."""
        if max_loaded < 1:
            raise ValueError("max_loaded must be >= 1")
        self.max_loaded = max_loaded
        self._start, self._stop, self._on_change, self._clock = start, stop, on_change, clock
        self._check, self._free_memory = check, free_memory
        self._loaded: OrderedDict[str, LoadedModel[Served]] = OrderedDict()  # LRU first
        self._load_lock = asyncio.Lock()
        self._drained = asyncio.Event()  # set whenever a model's last stream ends
        self.loading = ""  # the model being loaded now
        self.counters = CacheCounters()

    # ---- reading -------------------------------------------------------------------------------------
    def loaded_names(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    def loaded(self) -> list[LoadedModel[Served]]:
        return list(self._loaded.values())

    def get(self, name: str) -> LoadedModel[Served] | None:
        return self._loaded.get(name)

    # ---- use -----------------------------------------------------------------------------------------
    async def acquire(self, name: str) -> LoadedModel[Served]:
        """The model's engine with one stream pinned (release it); loads the model first when needed."""
        while True:
            model = self._loaded.get(name)
            if model is not None:
                return self._pin(model)
            # Shielded: a caller that goes away mid-load leaves the load to finish (an engine half built on its
            # thread would hold memory untracked) and its pin to be dropped.
            load = asyncio.ensure_future(self._load(name, pin=True))
            try:
                model, _ = await asyncio.shield(load)
            except asyncio.CancelledError:
                load.add_done_callback(self._release_abandoned)
                raise
            if model is not None:
                return model

    def release(self, model: LoadedModel[Served]) -> None:
        model.num_streams -= 1
        if model.num_streams == 0:
            self._drained.set()

    def _release_abandoned(self, load: asyncio.Future) -> None:
        if not load.cancelled() and load.exception() is None and load.result()[0] is not None:
            self.release(load.result()[0])

    async def ensure_loaded(self, name: str) -> LoadResult:
        """Load `name` unless it is loaded (then it only becomes the most recently used)."""
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return LoadResult(self.loaded_names(), (), 0.0, True)
        started = self._clock()
        model, unloaded = await asyncio.shield(self._load(name, pin=False))
        return LoadResult(self.loaded_names(), unloaded, self._clock() - started, model is None)

    async def close(self) -> None:
        for model in list(self._loaded.values()):
            await self._stop(model.served)
        self._loaded.clear()

    # ---- internals -----------------------------------------------------------------------------------
    def _pin(self, model: LoadedModel[Served]) -> LoadedModel[Served]:
        model.num_streams += 1
        self._loaded.move_to_end(model.name)
        return model

    async def _load(self, name: str, pin: bool) -> tuple[LoadedModel[Served] | None, tuple[str, ...]]:
        """Loads `name` under the load lock: (the model, what was unloaded for it); (None, ()) when it was loaded
        meanwhile (the caller looks again)."""
        async with self._load_lock:
            if name in self._loaded:
                return None, ()
            try:
                self._check(name)
            except Exception as err:
                self.counters.num_load_failures += 1
                raise ModelLoadError(f"cannot load {name}: {err}") from err
            unloaded = await self._make_room()
            self.loading = name
            self._on_change()
            started = self._clock()
            try:
                served = await self._start(name)
            except Exception as err:
                self.counters.num_load_failures += 1
                logger.exception("loading %s failed", name)
                raise ModelLoadError(f"loading {name} failed: {err}") from err
            finally:
                self.loading = ""
            model = LoadedModel(name, served)
            self._loaded[name] = model
            self.counters.num_loads += 1
            logger.info("loaded %s in %.2f s (loaded now: %s)", name, self._clock() - started,
                        ", ".join(self._loaded))
            if pin:
                self._pin(model)  # before the lock is released: no other load can unload it first
            self._on_change()
            return model, unloaded

    async def _make_room(self) -> tuple[str, ...]:
        unloaded: list[str] = []
        while len(self._loaded) >= self.max_loaded:
            victim = choose_victim([(m.name, m.num_streams) for m in self._loaded.values()])
            if victim is None:
                self._drained.clear()
                await self._drained.wait()  # every loaded model has streams: the first to drain goes
                continue
            model = self._loaded.pop(victim)
            await self._stop(model.served)
            del model
            self._free_memory()  # the weights' memory goes back before the next model's comes
            self.counters.num_unloads += 1
            self.counters.unloaded = [*self.counters.unloaded[-63:], victim]
            unloaded.append(victim)
            logger.info("unloaded %s (least recently used without streams)", victim)
            self._on_change()
        return tuple(unloaded)
