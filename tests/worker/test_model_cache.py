"""A shared-pool worker's model cache: LRU order, the unload victim, never unloading under a stream, loads one
at a time, failed and abandoned loads. Engines are stand-ins (the cache only starts and stops them)."""

from __future__ import annotations

import asyncio

import pytest

from flotilla.worker.model_cache import ModelCache, ModelLoadError, choose_victim


class Engines:
    def __init__(self, fail: tuple[str, ...] = ()):
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.fail = fail
        self.gate: asyncio.Event | None = None  # set: starts wait for it

    async def start(self, name: str) -> str:
        if self.gate is not None:
            await self.gate.wait()
        if name in self.fail:
            raise RuntimeError("no such weights")
        self.started.append(name)
        return f"engine-{name}"

    async def stop(self, engine: str) -> None:
        self.stopped.append(engine.removeprefix("engine-"))


def make(max_loaded: int = 2, **kwargs) -> tuple[ModelCache, Engines]:
    engines = Engines(**kwargs)
    return ModelCache(max_loaded, engines.start, engines.stop), engines


def test_the_victim_is_the_least_recently_used_without_streams():
    assert choose_victim([("a", 0), ("b", 0)]) == "a"
    assert choose_victim([("a", 2), ("b", 0), ("c", 0)]) == "b"
    assert choose_victim([("a", 1), ("b", 1)]) is None
    assert choose_victim([]) is None


async def test_lru_unloads_the_least_recently_used_model():
    cache, engines = make()
    for name in ("a", "b"):
        cache.release(await cache.acquire(name))
    cache.release(await cache.acquire("a"))  # a is the most recent now
    assert cache.loaded_names() == ("b", "a")
    result = await cache.ensure_loaded("c")
    assert result.unloaded == ("b",) and result.loaded == ("a", "c") and not result.already_loaded
    assert engines.started == ["a", "b", "c"] and engines.stopped == ["b"]
    again = await cache.ensure_loaded("a")
    assert again.already_loaded and again.unloaded == () and cache.loaded_names() == ("c", "a")


async def test_a_model_with_a_live_stream_is_never_unloaded():
    cache, engines = make()
    a = await cache.acquire("a")  # a stream on a, the least recently used
    cache.release(await cache.acquire("b"))
    result = await cache.ensure_loaded("c")
    assert result.unloaded == ("b",) and cache.loaded_names() == ("a", "c") and a.num_streams == 1
    c = await cache.acquire("c")
    waiting = asyncio.create_task(cache.ensure_loaded("d"))  # a and c both stream: it must wait
    await asyncio.sleep(0.01)
    assert not waiting.done() and engines.stopped == ["b"]
    cache.release(c)  # c drains first: it goes, although a is older
    assert (await waiting).unloaded == ("c",)
    assert cache.loaded_names() == ("a", "d") and a.num_streams == 1


async def test_concurrent_requests_share_one_load():
    cache, engines = make()
    engines.gate = asyncio.Event()
    first, second = (asyncio.create_task(cache.acquire("a")) for _ in range(2))
    await asyncio.sleep(0.01)
    assert cache.loading == "a"
    engines.gate.set()
    models = await asyncio.gather(first, second)
    assert engines.started == ["a"] and models[0] is models[1] and models[0].num_streams == 2
    assert cache.loading == ""


async def test_a_failed_load_raises_and_leaves_the_cache_usable():
    cache, _ = make(fail=("bad",))
    with pytest.raises(ModelLoadError, match="bad"):
        await cache.acquire("bad")
    assert cache.loaded_names() == () and cache.counters.num_load_failures == 1 and cache.loading == ""
    cache.release(await cache.acquire("a"))
    assert cache.loaded_names() == ("a",)


async def test_a_caller_that_leaves_mid_load_drops_its_pin():
    cache, engines = make(max_loaded=1)
    engines.gate = asyncio.Event()
    task = asyncio.create_task(cache.acquire("a"))
    await asyncio.sleep(0.01)
    task.cancel()
    engines.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)  # the shielded load finishes on its own
    assert cache.loaded_names() == ("a",) and cache.get("a").num_streams == 0
    assert (await cache.ensure_loaded("b")).unloaded == ("a",)  # unpinned: it may go


async def test_a_model_that_fails_its_check_unloads_nothing():
    engines = Engines()

    def check(name: str) -> None:
        if name == "bad":
            raise ValueError("truncated weights")

    cache = ModelCache(1, engines.start, engines.stop, check=check)
    cache.release(await cache.acquire("a"))
    with pytest.raises(ModelLoadError, match="truncated"):
        await cache.ensure_loaded("bad")
    assert cache.loaded_names() == ("a",) and engines.stopped == []


async def test_an_unloaded_engine_is_freed(tiny_checkpoint):
    """Real engines: once unloaded, nothing keeps the model's weights alive (the next load needs their memory)."""
    import weakref

    from flotilla.engine.async_engine import AsyncEngine
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.engine import LLMEngine

    async def start(name: str) -> AsyncEngine:
        engine = AsyncEngine(lambda: LLMEngine(EngineConfig(str(tiny_checkpoint), device="cpu", num_kv_blocks=8)))
        await engine.start()
        return engine

    async def stop(engine: AsyncEngine) -> None:
        await engine.shutdown()

    cache = ModelCache(1, start, stop)
    cache.release(await cache.acquire("a"))
    weights = weakref.ref(cache.get("a").served.engine.runner.model)
    cache.release(await cache.acquire("b"))
    assert cache.loaded_names() == ("b",) and weights() is None
    await cache.close()
