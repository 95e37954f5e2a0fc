"""SSE plumbing shared by the dialects: the first event is awaited before the 200 goes out, so that a
request refused by the router still gets its proper status and error body."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.gateway.generation import Outcome, next_event, until_disconnected

Events = AsyncIterator[common.TokenChunk | Outcome]
PING_INTERVAL_S = 15


def sse_json(payload: object, event: str | None = None) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(payload, separators=(",", ":")), event=event)


async def first_event(request: Request, events: Events) -> common.TokenChunk | Outcome:
    try:
        return await until_disconnected(request, next_event(events))
    except BaseException:
        await events.aclose()
        raise


def sse_response(body: AsyncIterator[ServerSentEvent],
                 ping_message_factory: Callable[[], ServerSentEvent] | None = None) -> EventSourceResponse:
    return EventSourceResponse(body, ping=PING_INTERVAL_S, sep="\n", ping_message_factory=ping_message_factory,
                               headers={"cache-control": "no-cache"})
