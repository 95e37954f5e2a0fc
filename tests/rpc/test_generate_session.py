"""Generate sessions (rpc/session_server.py + rpc/session_client.py) over real grpc.aio in the test's loop:
many streams on one call behave like separate Generate calls (order, end, errors, cancel, deadline, the
peer going away), and what a handler writes while the wire is busy leaves in one message."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.worker.v1 import worker_pb2_grpc
from flotilla.rpc.failover import LOST_STATUSES
from flotilla.rpc.session_client import SessionClient
from flotilla.rpc.session_server import serve_session

from tests.support.waiting import async_wait_until


class ScriptedWorker(worker_pb2_grpc.WorkerServiceServicer):
    """request.model picks the behaviour; max_tokens is the number of chunks."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.reports: dict[str, pb.StreamReport | None] = {}  # what a close carried, by request id
        self.metadata: dict[str, dict[str, str]] = {}

    async def GenerateSession(self, actions, context):
        await serve_session(actions, context, self.generate)

    async def generate(self, request: pb.GenerateRequest, sink) -> None:
        self.metadata[request.request_id] = dict(sink.invocation_metadata())
        if request.model == "boom":
            raise RuntimeError("handler bug")
        try:
            for i in range(request.sampling.max_tokens):
                await sink.write(pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[i], text=request.request_id)))
                if request.model == "slow":
                    await asyncio.sleep(0.01)
            if request.model == "hang":
                await asyncio.Event().wait()
            await sink.write(pb.GenerateResponse(finished=pb.Finished(reason=pb.FINISH_REASON_LENGTH)))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            self.reports[request.request_id] = sink.report
            raise


@pytest.fixture
async def served():
    worker = ScriptedWorker()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    client = SessionClient(stub.GenerateSession)
    yield worker, server, stub, client
    client.close()
    await channel.close()
    await server.stop(0)


def _request(request_id: str, model: str = "ok", num_chunks: int = 3) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, model=model, sampling=pb.SamplingParams(max_tokens=num_chunks))


async def _drain(stream) -> list[pb.GenerateResponse]:
    return [response async for response in stream]


async def test_concurrent_streams_each_get_their_own_events_in_order(served):
    worker, _, _, client = served
    streams = {f"r{i}": client.generate(_request(f"r{i}", "slow", num_chunks=5 + i), [("tier", f"t{i}")])
               for i in range(20)}
    results = await asyncio.gather(*(_drain(stream) for stream in streams.values()))
    for (request_id, _), responses in zip(streams.items(), results):
        i = int(request_id[1:])
        assert [r.chunk.token_ids[0] for r in responses[:-1]] == list(range(5 + i))
        assert {r.chunk.text for r in responses[:-1]} == {request_id}
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert worker.metadata[request_id] == {"tier": f"t{i}"}


async def test_what_piles_up_while_the_wire_is_busy_leaves_in_one_message(served):
    # The handler writes 20 chunks and its finish without suspending: all of it is in the outbox before
    # the writer runs, so one SessionEvents message carries the chunks, the finish and the end marker.
    _, _, stub, _ = served
    call = stub.GenerateSession()
    await call.write(pb.SessionActions(open=[pb.SessionOpen(stream_id=7, request=_request("r", num_chunks=20))]))
    message = await call.read()
    assert [e.stream_id for e in message.events] == [7] * 22
    assert message.events[-1].end and message.events[-1].status_code == 0
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_cancel_aborts_only_that_stream(served):
    worker, _, _, client = served
    hanging = client.generate(_request("hang", "hang", num_chunks=1))
    other = client.generate(_request("other", "slow", num_chunks=30))
    assert (await anext(hanging)).chunk.token_ids == [0]
    assert hanging.cancel() is True
    assert hanging.cancel() is False  # already ended
    with pytest.raises(StopAsyncIteration):
        await anext(hanging)
    await async_wait_until(lambda: "hang" in worker.cancelled, 10, "the worker to see hang cancelled")
    assert (await _drain(other))[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert "other" not in worker.cancelled


async def test_a_close_cancels_the_stream_with_the_callers_report_in_hand(served):
    worker, _, _, client = served
    closed, cancelled = client.generate(_request("closed", "hang")), client.generate(_request("cancelled", "hang"))
    for stream in (closed, cancelled):
        assert (await stream.__anext__()).chunk.token_ids == [0]
    assert closed.cancel(pb.StreamReport(finished=True, num_output_tokens=7, ttft_s=0.5))
    assert cancelled.cancel()
    await async_wait_until(lambda: len(worker.cancelled) == 2, 5, "both handlers cancelled")
    assert worker.reports["closed"] == pb.StreamReport(finished=True, num_output_tokens=7, ttft_s=0.5)
    assert worker.reports["cancelled"] is None


async def test_a_failing_handler_fails_its_stream_with_internal_and_spares_the_others(served):
    _, _, _, client = served
    other = client.generate(_request("other", "slow", num_chunks=10))
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await _drain(client.generate(_request("bad", "boom")))
    assert failure.value.code() == grpc.StatusCode.INTERNAL
    assert "handler bug" in failure.value.details()
    assert (await _drain(other))[-1].HasField("finished")


async def test_deadline_fails_the_stream_and_cancels_the_handler(served):
    worker, _, _, client = served
    stream = client.generate(_request("late", "hang", num_chunks=1), timeout=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await _drain(stream)
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await async_wait_until(lambda: "late" in worker.cancelled, 10, "the worker to see late cancelled")


async def test_peer_going_away_fails_every_open_stream_as_lost_then_a_new_session_opens(served):
    worker, server, _, client = served
    streams = [client.generate(_request(f"h{i}", "hang", num_chunks=1)) for i in range(3)]
    for stream in streams:
        await anext(stream)
    await server.stop(0)
    for stream in streams:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await _drain(stream)
        assert failure.value.code() in LOST_STATUSES  # the router's failover takes these over
    await async_wait_until(lambda: len(worker.cancelled) == 3, 10, "the worker to see 3 streams cancelled")
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # nothing listens now: a fresh session, refused
        await _drain(client.generate(_request("after")))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_closing_the_client_cancels_the_callees_streams(served):
    worker, _, _, client = served
    stream = client.generate(_request("h", "hang", num_chunks=1))
    await anext(stream)
    client.close()
    await async_wait_until(lambda: "h" in worker.cancelled, 10, "the worker to see h cancelled")
    with pytest.raises(grpc.aio.AioRpcError) as closed:
        await _drain(stream)
    assert closed.value.code() == grpc.StatusCode.CANCELLED


def test_long_prompts_travel_in_several_messages():
    from flotilla.rpc.session_client import MAX_ACTIONS_BYTES, _split

    prompt = list(range(1 << 17, (1 << 17) + MAX_ACTIONS_BYTES // 8))  # 3-byte varints: ~3/8 of the bound
    actions = pb.SessionActions(cancel=[9], open=[pb.SessionOpen(stream_id=i, request=pb.GenerateRequest(
        request_id=f"r{i}", prompt_token_ids=prompt)) for i in range(5)])
    messages = _split(actions)
    assert [len(m.open) for m in messages] == [2, 2, 1]
    assert list(messages[0].cancel) == [9]
    assert [o.stream_id for m in messages for o in m.open] == list(range(5))
    assert all(m.ByteSize() <= MAX_ACTIONS_BYTES for m in messages)


async def test_next_ready_hands_out_what_has_arrived_but_leaves_the_end_to_iteration(served):
    _, _, _, client = served
    stream = client.generate(_request("together", "ok", num_chunks=4))  # all written before the writer runs
    first = await anext(stream)
    await asyncio.sleep(0.05)  # the whole message is in by now
    following = []
    while (response := stream.next_ready()) is not None:
        following.append(response)
    assert [r.chunk.token_ids[0] for r in [first, *following[:3]]] == [0, 1, 2, 3]
    assert following[-1].HasField("finished") and stream.next_ready() is None
    assert await _drain(stream) == []  # the end marker: iteration stops cleanly


async def test_a_deadline_that_passes_while_events_flow_fails_the_stream(served):
    worker, _, _, client = served
    stream = client.generate(_request("steady", "slow", num_chunks=1000), timeout=0.2)
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for _ in stream:
            received += 1
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 0 < received < 1000
    await async_wait_until(lambda: "steady" in worker.cancelled, 10, "the worker to see steady cancelled")


async def test_a_direct_handler_takes_responses_as_they_arrive_and_leaves_the_end_to_iteration(served):
    _, _, _, client = served
    stream = client.generate(_request("direct", "slow", num_chunks=5))
    taken = []

    def take_chunks(response: pb.GenerateResponse) -> bool:
        if not response.HasField("chunk"):
            return False  # left to iteration
        taken.append(response.chunk.token_ids[0])
        return True

    stream.deliver_directly(take_chunks)
    rest = await _drain(stream)
    assert taken == [0, 1, 2, 3, 4]
    assert len(rest) == 1 and rest[0].HasField("finished")


async def test_a_direct_handler_never_overtakes_a_response_the_reader_still_holds(served):
    _, _, _, client = served
    stream = client.generate(_request("held", "slow", num_chunks=8))
    relayed = []  # where a relay's writes land, direct and iterated alike

    def take_chunks(response: pb.GenerateResponse) -> bool:
        if not response.HasField("chunk"):
            return False
        relayed.append(response)
        return True

    first = await anext(stream)  # read before the relay sets its handler (a worker's first ones can be)
    stream.deliver_directly(take_chunks)
    await asyncio.sleep(0.05)  # the reader holds it while the next ones arrive
    relayed.append(first)
    async for response in stream:
        relayed.append(response)
    assert [r.chunk.token_ids[0] for r in relayed[:-1]] == list(range(8)) and relayed[-1].HasField("finished")


async def test_a_failing_direct_handler_falls_back_to_iteration_and_spares_the_session(served):
    _, _, _, client = served
    stream = client.generate(_request("faulty", "slow", num_chunks=4))
    other = client.generate(_request("bystander", "slow", num_chunks=4))

    def broken(response: pb.GenerateResponse) -> bool:
        raise RuntimeError("handler bug")

    stream.deliver_directly(broken)
    responses, others = await asyncio.gather(_drain(stream), _drain(other))
    assert [r.chunk.token_ids[0] for r in responses[:-1]] == [0, 1, 2, 3] and responses[-1].HasField("finished")
    assert len(others) == 5 and others[-1].HasField("finished")
