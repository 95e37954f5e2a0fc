"""The gateway's model list: a request that arrives while the list is being read (right after the gateway
started or restarted) is answered from that list, not with a 404 from the empty one before it."""

from __future__ import annotations

import asyncio

import pytest

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.tokenizer_files import files_digest
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.model_registry import ModelRegistry


FILES = {"tokenizer.json": b"{}"}  # what the fake tokenizer builder gets


class SlowRouter:
    """list_models answers once `answer` is set, with one model."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.num_lists = 0

    async def list_models(self) -> list[common.ModelInfo]:
        self.num_lists += 1
        await self.answer.wait()
        return [common.ModelInfo(name="m", version="v1", max_model_len=64, assets_digest=files_digest(FILES))]

    async def get_model_assets(self, digest: str) -> dict[str, bytes]:
        return dict(FILES)


def registry(router: SlowRouter) -> ModelRegistry:
    return ModelRegistry(router, tokenizer_builder=lambda files: object(), min_refresh_gap_s=60)


async def test_a_request_during_the_first_refresh_waits_for_its_answer():
    router = SlowRouter()
    models = registry(router)
    first = asyncio.create_task(models.refresh())  # the refresher's first pass, as at start-up
    await asyncio.sleep(0)
    resolving = asyncio.create_task(models.resolve("m"))
    await asyncio.sleep(0.01)
    assert not resolving.done()  # it waits for the list being read instead of answering 404
    router.answer.set()
    assert (await resolving).name == "m"
    await first
    assert router.num_lists == 1  # and it did not read the list a second time


async def test_an_unknown_model_is_still_a_404_once_the_list_is_read():
    router = SlowRouter()
    router.answer.set()
    models = registry(router)
    await models.refresh()
    with pytest.raises(GatewayError, match="model 'other' not found"):
        await models.resolve("other")
