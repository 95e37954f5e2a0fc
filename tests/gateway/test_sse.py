"""SSEResponse at the ASGI level: events go out as they come, an idle stream gets pings, and the body is
closed (its cleanup cancels the router call) when the client disconnects or the body ends."""

from __future__ import annotations

import asyncio

from flotilla.gateway.sse import SSEResponse, sse_data, sse_json


class _Client:
    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.disconnect = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def receive(self) -> dict:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_sse_json_is_one_compact_event():
    assert sse_json({"a": [1, None], "t": "é"}) == 'data: {"a":[1,null],"t":"é"}\n\n'.encode()
    assert sse_json({"type": "ping"}, "ping") == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert sse_data("[DONE]") == b"data: [DONE]\n\n"


async def test_events_then_the_end_of_the_body():
    client = _Client()
    closed = []

    async def body():
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    await SSEResponse(body())({"type": "http"}, client.receive, client.send)
    start = client.sent[0]
    assert start["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert client.bodies == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False and closed == [True]


async def test_an_idle_stream_is_pinged_and_a_disconnect_closes_the_body():
    client = _Client()
    waiting, closed = asyncio.Event(), asyncio.Event()

    async def body():
        try:
            yield b"data: first\n\n"
            waiting.set()
            await asyncio.Event().wait()  # a generation that produces nothing for a while
            yield b"data: never\n\n"
        finally:
            closed.set()

    response = SSEResponse(body(), ping=b": keepalive\n\n", ping_interval_s=0.05)
    served = asyncio.create_task(response({"type": "http"}, client.receive, client.send))
    await waiting.wait()
    await asyncio.sleep(0.18)
    assert client.bodies[0] == b"data: first\n\n"
    assert 2 <= client.bodies.count(b": keepalive\n\n") <= 4
    client.disconnect.set()
    await asyncio.wait_for(served, 5)
    assert closed.is_set() and b"data: never\n\n" not in client.bodies


async def test_a_body_that_fails_fails_the_response():
    client = _Client()

    async def body():
        yield b"data: 1\n\n"
        raise ValueError("boom")

    try:
        await SSEResponse(body())({"type": "http"}, client.receive, client.send)
    except ValueError as err:
        assert str(err) == "boom"
    else:
        raise AssertionError("the body's error was swallowed")
