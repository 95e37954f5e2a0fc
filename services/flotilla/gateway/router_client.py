"""The gateway's only way out: the router's Generate streams (on one session) and its model list, over grpc.aio."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.rpc.options import aio_channel
from flotilla.rpc.session_client import SessionClient


class RouterBackend(Protocol):
    """What the app needs from the router; tests can pass an in-process fake with the same methods."""

    def generate(
        self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[common.GenerateResponse]: ...

    async def list_models(self) -> list[common.ModelInfo]: ...


class RouterClient:
    """RouterService client. Closing a generate() iterator cancels the call, which aborts the request."""

    def __init__(self, address: str, list_timeout_s: float = 5.0):
        self.address = address
        self._list_timeout_s = list_timeout_s
        self._channel = aio_channel(address)  # keepalive finds a dead router; 64 MiB messages (long prompts)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        # Every request's stream rides one GenerateSession call: a step's tokens for all of them arrive
        # in one message instead of one message per request.
        self._session = SessionClient(self._stub.GenerateSession)

    async def generate(
        self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[common.GenerateResponse]:
        """`metadata`: gRPC metadata for the call (trace context, tier)."""
        call = self._session.generate(request, metadata)
        try:
            async for response in call:
                yield response
        finally:
            # Reached on completion, on an error, on aclose() and on task cancellation alike; cancelling
            # a finished call is a no-op, an unfinished one tells the router to abort the request.
            call.cancel()

    async def list_models(self) -> list[common.ModelInfo]:
        response = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=self._list_timeout_s)
        return list(response.models)

    async def close(self) -> None:
        self._session.close()
        await self._channel.close()
