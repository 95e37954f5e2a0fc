"""One batch item as an ordinary request to the gateway's own ASGI app, in this process: the same route,
validation, admission, quotas, router call and usage record as a client's call, acting as the job's owner
(auth.acting_as) in the batch class. What comes back is the status and body that client would have got.

Cancelling the call (batch cancelled or expired) cancels the handler, which cancels its router call, so the
engine aborts the item.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

from flotilla.gateway.auth import Principal, acting_as


@dataclass(frozen=True)
class AppResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict | None:
        try:
            value = json.loads(self.body)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


async def call_app(app: ASGIApp, principal: Principal, path: str, body: bytes) -> AppResponse:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"flotilla-batch"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    never = asyncio.Event()  # the in-process "client" never disconnects; cancellation ends the call instead
    status, headers, chunks = 500, {}, []

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    with acting_as(principal):
        await app(scope, receive, send)
    return AppResponse(status, headers, b"".join(chunks))
