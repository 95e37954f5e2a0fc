"""RouterClient against the fake router over real grpc.aio, in the test's own event loop."""

from __future__ import annotations

from contextlib import aclosing

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.engine.request import FinishReason
from flotilla.gateway.router_client import RouterClient
from flotilla.rpc.stream_events import Chunk, Finished, Usage

from tests.support.waiting import async_wait_until

from .fake_router import CACHED_TOKENS, FakeRouter


@pytest.fixture
async def router(checkpoint_dir):
    fake = FakeRouter(str(checkpoint_dir))
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = RouterClient(f"127.0.0.1:{port}")
    yield fake, client
    await client.close()
    await server.stop(0)


async def test_list_models(router):
    fake, client = router
    assert [m.name for m in await client.list_models()] == [m.name for m in fake.models]


async def test_model_assets_arrive_whole_over_many_chunks(router):
    fake, client = router
    assert len(fake.tokenizer_files["tokenizer.json"]) > 64 * 1024  # the fake sends 64 KiB chunks
    assert await client.get_model_assets(fake.assets_digest) == fake.tokenizer_files
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.get_model_assets("sha256:unknown")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_generate_streams_until_finished(router):
    _, client = router
    request = common.GenerateRequest(request_id="r1", model="tiny", prompt_token_ids=[1, 2],
                                     sampling=common.SamplingParams(max_tokens=3))
    events = [event async for event in client.generate(request)]
    # The fake router writes both chunks and the end before its session's writer runs: they arrive in one
    # message, and chunks that arrive together are read as one, each message decoded once.
    assert [type(event) for event in events] == [Chunk, Finished]
    assert list(events[0].token_ids) == [100, 101, 102] and events[0].text == "w0 w1 w2 "
    assert events[1].reason is FinishReason.LENGTH and events[1].usage == Usage(2, 3, CACHED_TOKENS)


async def test_closing_the_stream_at_a_yield_cancels_the_call(router):
    # The generator is suspended at `yield` (not inside a gRPC read) when it is closed: only the explicit
    # call.cancel() in its finally tells the router.
    fake, client = router
    request = common.GenerateRequest(request_id="r2", model="hang", sampling=common.SamplingParams(max_tokens=5))
    async with aclosing(client.generate(request)) as stream:
        first = await anext(stream)
        assert type(first) is Chunk
    await async_wait_until(lambda: "r2" in {r.request_id for r in fake.cancelled}, 10,
                           "the router to see r2 cancelled")
