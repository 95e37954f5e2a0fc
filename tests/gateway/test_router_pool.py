"""RouterPool over two real grpc.aio routers in the test's event loop (a small scripted RouterService each): the
model's owner is the same whatever order the gateway was given the addresses in; a stream whose router dies
mid-way goes on on the other with the prompt + the tokens already received, seamlessly (same tokens as an
undisturbed run, the caller's usage, both attempts counted); a stream queued on a dead router is submitted again
whole; new requests skip the dead router; fixed-batch calls fail over; the model lists are merged."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.gateway.router_pool import RouterPool
from flotilla.rpc.router_ownership import owner_order
from flotilla.rpc.batch_session import serve_batch_session
from flotilla.rpc.session_server import serve_session
from flotilla.rpc.stream_events import Chunk, Finished

MODEL = "m"
FIRST_TOKEN = 100  # the token at output index i is FIRST_TOKEN + i, whichever router's worker made it


class ScriptedRouter(router_pb2_grpc.RouterServiceServicer):
    """Streams FIRST_TOKEN + index for max_tokens tokens, one per chunk; `die_after` tokens into a stream it
    calls `on_die` (the test stops its server) and waits to be cut off; `hold` keeps streams queued."""

    def __init__(self, name: str):
        self.name = name
        self.requests: list[common.GenerateRequest] = []
        self.die_after: int | None = None
        self.on_die = None
        self.hold = False
        self.models = [common.ModelInfo(name=MODEL, version="v1", aliases=["alias-of-m"])]
        self.batch_calls: list[router_pb2.BatchCall] = []

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=self.models)

    async def GenerateSession(self, actions, context):
        async def handler(request: common.GenerateRequest, sink) -> None:
            self.requests.append(request)
            if self.hold:
                await asyncio.Event().wait()  # queued until the router dies
            start = request.num_previous_output_tokens
            for i in range(request.sampling.max_tokens):
                if self.die_after is not None and start + i == self.die_after:
                    self.on_die()
                    await asyncio.Event().wait()
                await sink.write(common.GenerateResponse(chunk=common.TokenChunk(
                    token_ids=[FIRST_TOKEN + start + i], text=f"<{start + i}>")))
                await asyncio.sleep(0)
            usage = common.Usage(prompt_tokens=len(request.prompt_token_ids),
                                 completion_tokens=request.sampling.max_tokens, cached_prompt_tokens=2)
            await sink.write(common.GenerateResponse(num_attempts=1, finished=common.Finished(
                reason=common.FINISH_REASON_LENGTH, usage=usage)))

        await serve_session(actions, context, handler)

    async def BatchGenerateSession(self, calls, context):
        def submit(call, resolve):
            self.batch_calls.append(call)
            resolve(router_pb2.BatchResult(call_id=call.call_id, output=f"{self.name}:{call.input}"))

        await serve_batch_session(calls, context, submit, lambda pending, call: None)


class Routers:
    def __init__(self):
        self.fakes: dict[str, ScriptedRouter] = {}
        self.servers: dict[str, grpc.aio.Server] = {}

    async def start(self, count: int) -> list[str]:
        for i in range(count):
            await self.start_one(f"r{i}", "127.0.0.1:0")
        return list(self.fakes)

    async def start_one(self, name: str, address: str) -> str:
        """A router at `address` (port 0: a free one), in place of any stopped there before."""
        fake = ScriptedRouter(name)
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
        address = f"127.0.0.1:{server.add_insecure_port(address)}"
        await server.start()
        self.fakes[address], self.servers[address] = fake, server
        return address

    def kill(self, address: str) -> None:
        asyncio.get_running_loop().create_task(self.servers[address].stop(0))

    async def stop(self) -> None:
        await asyncio.gather(*(server.stop(0) for server in self.servers.values()))


@pytest.fixture
async def routers():
    routers = Routers()
    addresses = await routers.start(2)
    pool = RouterPool(addresses, probe_interval_s=0.05, reconnect_grace_s=0.5)
    yield routers, pool, owner_order(addresses, MODEL)
    await pool.close()
    await routers.stop()


def request(max_tokens: int = 8, request_id: str = "r1") -> common.GenerateRequest:
    return common.GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=[1, 2, 3],
                                  sampling=common.SamplingParams(max_tokens=max_tokens))


async def read_all(stream) -> tuple[list[int], Finished]:
    tokens = []
    try:
        async for event in stream:
            if type(event) is Chunk:
                tokens.extend(event.token_ids)
            else:
                return tokens, event
    finally:
        await stream.aclose()
    raise AssertionError("no last event")


def test_the_owner_does_not_depend_on_the_order_the_addresses_were_given():
    addresses = [f"10.0.0.{i}:50051" for i in range(5)]
    owners = {owner_order(addresses, name)[0] for name in ("a", "b", "c", "d", "e", "f", "g", "h")}
    assert len(owners) > 1  # models spread over the routers
    for name in ("a", "b"):
        assert owner_order(addresses, name) == owner_order(list(reversed(addresses)), name)


async def test_aliases_and_versions_share_their_models_router(routers):
    _, pool, order = routers
    await pool.list_models()  # learns the aliases
    assert [c.address for c in pool.routers_for("alias-of-m")] == order
    assert [c.address for c in pool.routers_for(f"{MODEL}@v1")] == order


async def test_a_stream_whose_router_dies_goes_on_on_the_other_seamlessly(routers):
    fakes, pool, (owner, other) = routers
    fakes.fakes[owner].die_after = 3
    fakes.fakes[owner].on_die = lambda: fakes.kill(owner)
    tokens, finished = await read_all(pool.generate(request(max_tokens=8)))
    assert tokens == [FIRST_TOKEN + i for i in range(8)]  # no token lost or repeated
    assert [len(r.prompt_token_ids) for r in fakes.fakes[owner].requests] == [3]
    resumed = fakes.fakes[other].requests[0]
    assert list(resumed.prompt_token_ids) == [1, 2, 3, FIRST_TOKEN, FIRST_TOKEN + 1, FIRST_TOKEN + 2]
    assert resumed.num_previous_output_tokens == 3 and resumed.sampling.max_tokens == 5
    assert finished.usage.prompt_tokens == 3 and finished.usage.completion_tokens == 8  # the caller's usage
    assert finished.usage.cached_prompt_tokens == 2 and finished.num_attempts == 2
    # New requests go to the survivor at once, without a failed attempt on the dead router first.
    tokens, finished = await read_all(pool.generate(request(max_tokens=2, request_id="r2")))
    assert finished.num_attempts == 1 and fakes.fakes[other].requests[-1].request_id == "r2"


async def test_a_request_queued_on_a_dead_router_is_submitted_again_whole(routers):
    fakes, pool, (owner, other) = routers
    fakes.fakes[owner].hold = True
    stream = pool.generate(request(max_tokens=4))
    reading = asyncio.ensure_future(read_all(stream))
    while not fakes.fakes[owner].requests:
        await asyncio.sleep(0.01)  # polling for the router to hold it
    fakes.kill(owner)
    tokens, finished = await reading
    assert tokens == [FIRST_TOKEN + i for i in range(4)]
    assert fakes.fakes[other].requests[0] == request(max_tokens=4)  # the same request, untouched


async def test_when_every_router_is_gone_the_call_error_is_raised(routers):
    fakes, pool, order = routers
    for address in order:
        fakes.kill(address)
    await asyncio.gather(*(fakes.servers[a].wait_for_termination() for a in order))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read_all(pool.generate(request()))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_request_arriving_while_the_only_router_restarts_waits_for_it_instead_of_failing():
    """A router killed and brought back at its address (the launcher's or Kubernetes' restart): a request that
    arrives before the gateway's channel has dialled it again is placed once it has, not refused with 503."""
    routers = Routers()
    (address,) = await routers.start(1)
    pool = RouterPool([address], reconnect_grace_s=10.0)
    try:
        await read_all(pool.generate(request(max_tokens=2)))  # connected
        routers.kill(address)
        await routers.servers[address].wait_for_termination()
        reading = asyncio.ensure_future(read_all(pool.generate(request(max_tokens=3, request_id="r2"))))
        await asyncio.sleep(0.3)  # it failed on the dead router and waits for one to come back
        assert not reading.done()
        await routers.start_one("r0-again", address)
        tokens, finished = await reading
        assert tokens == [FIRST_TOKEN + i for i in range(3)]
        assert routers.fakes[address].name == "r0-again" and routers.fakes[address].requests[0].request_id == "r2"
    finally:
        await pool.close()
        await routers.stop()


async def test_fixed_batch_calls_fail_over_and_the_model_lists_merge(routers):
    fakes, pool, (owner, other) = routers
    fakes.fakes[other].models = [common.ModelInfo(name="only-on-other", version="v9")]
    names = sorted((m.name, m.version) for m in await pool.list_models())
    assert names == [(MODEL, "v1"), ("only-on-other", "v9")]
    result = await pool.batch_generate(router_pb2.BatchCall(request_id="b1", model=MODEL, input="x"))
    assert result.output == f"{fakes.fakes[owner].name}:x"
    fakes.kill(owner)
    await fakes.servers[owner].wait_for_termination()
    result = await pool.batch_generate(router_pb2.BatchCall(request_id="b2", model=MODEL, input="y"))
    assert result.output == f"{fakes.fakes[other].name}:y"
    assert [m.name for m in await pool.list_models()] == ["only-on-other"]  # the dead router's list is gone
