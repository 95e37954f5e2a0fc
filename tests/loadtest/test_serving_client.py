"""The benchmark's streaming client against a real HTTP server (aiohttp.web on loopback) that writes SSE the
ways servers do: `\\n` or `\\r\\n` line ends, comment pings, events split across writes, usage in a last chunk."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from loadtest.serving.client import Endpoint, run_workload
from loadtest.serving.workload import RequestSpec


def _chunk(text: str | None, usage: dict | None = None) -> dict:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return {"object": "chat.completion.chunk", "choices": choices, "usage": usage}


async def _serve(request: web.Request, newline: bytes, split_writes: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    events = [b": ping", b"data: " + json.dumps(_chunk("")).encode(),
              b"data: " + json.dumps(_chunk("a b")).encode(),  # one event carrying two tokens
              b"event: x" + newline + b"data: " + json.dumps(_chunk("c")).encode(),
              b"data: " + json.dumps(_chunk(None, {"prompt_tokens": 7, "completion_tokens": 3})).encode(),
              b"data: [DONE]"]
    payload = b"".join(event.replace(b"\n", newline) + newline + newline for event in events)
    pieces = [payload[i:i + 5] for i in range(0, len(payload), 5)] if split_writes else [payload]
    for piece in pieces:
        await response.write(piece)
        await asyncio.sleep(0)
    return response


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("split_writes", [False, True], ids=["whole", "split"])
async def test_the_client_reads_every_event_and_the_usage(newline, split_writes):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _serve(request, newline, split_writes)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        spec = RequestSpec(0, 0.0, ({"role": "user", "content": "hi"},), 3, "t", "paid", "", "chat")
        run = await run_workload(Endpoint("x", f"http://127.0.0.1:{port}/v1", "m"), [spec], progress=False)
    finally:
        await runner.cleanup()
    (result,) = run.results
    assert result.ok and result.error == ""
    assert (result.prompt_tokens, result.output_tokens) == (7, 3)
    assert len(result.chunk_times_s) == 2 and len(result.itl_s) == 1  # content events: "a b" and "c"
    assert result.ttft_s is not None and result.e2e_s >= result.ttft_s
