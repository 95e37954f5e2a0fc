"""The gateway's way out: placement leases on the router and streams from the workers (direct_stream.py) when
the router grants leases, else the router's Generate streams (on one session, the relay path); the model list
and the models' tokenizer files, over grpc.aio. A stream's messages are decoded here, once each, into
StreamEvents (rpc/convert.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.engine.tokenizer_files import MAX_TOTAL_BYTES
from flotilla.gateway.direct_stream import DirectStream, WorkerSessions, next_merged
from flotilla.rpc.convert import stream_event
from flotilla.rpc.batch_session import BatchSessionClient
from flotilla.rpc.model_assets import receive_assets
from flotilla.rpc.options import aio_channel
from flotilla.rpc.tls import InternalTLS
from flotilla.rpc.session_client import SessionClient, SessionStream
from flotilla.rpc.stream_events import StreamEvent


ASSETS_TIMEOUT_S = 60.0  # tens of MB for the largest tokenizers
STREAM_PATHS = ("auto", "direct", "relay")  # auto: direct when the router grants leases (ListModels says)


class RouterBackend(Protocol):
    """What the app needs from the router; tests can pass an in-process fake with the same methods."""

    def generate(
        self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[StreamEvent]:
        """The request's events; the iterator's `aclose()` cancels an unfinished call."""

    async def list_models(self) -> list[common.ModelInfo]: ...

    async def batch_generate(self, call: router_pb2.BatchCall) -> router_pb2.BatchResult:
        """One call of a fixed-batch model, answered once; raises grpc.RpcError when the router is gone."""

    async def get_model_assets(self, digest: str) -> dict[str, bytes]: ...

    # Optional: async queue_load(models) -> GetQueueLoadResponse, the router's queue wait per model
    # (queue_load.py); a backend without it degrades nothing.


class RouterStream:
    """One request's events from the router, each decoded once. Token chunks that have already arrived together
    leave as one: a gateway that falls behind sends a client several tokens per SSE event instead of working
    through a backlog one token at a time. `aclose()` (on completion, errors and cancellation alike) cancels an
    unfinished call, which aborts the request in the engine."""

    __slots__ = ("_call", "_held")

    def __init__(self, call: SessionStream):
        self._call = call
        self._held: common.GenerateResponse | None = None  # a non-chunk event read while merging

    def __aiter__(self) -> RouterStream:
        return self

    async def __anext__(self) -> StreamEvent:
        response, self._held = self._held, None
        if response is None:
            response = await self._call.__anext__()
        response, self._held = next_merged(self._call, response)  # consecutive chunks leave as one
        return stream_event(response)

    async def aclose(self) -> None:
        self._call.cancel()


class RouterClient:
    """RouterService client. Closing a generate() iterator cancels the call, which aborts the request."""

    def __init__(self, address: str, list_timeout_s: float = 5.0, tls: InternalTLS | None = None,
                 stream_path: str = "auto"):
        if stream_path not in STREAM_PATHS:
            raise ValueError(f"stream_path must be one of {STREAM_PATHS}, got {stream_path!r}")
        self.address = address
        self.stream_path = stream_path
        self.grants_leases = False  # the router's last ListModels said it signs leases
        self._list_timeout_s = list_timeout_s
        # keepalive finds a dead router; 64 MiB messages (long prompts)
        self._channel = aio_channel(address, tls, "router")
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        # Every request's stream rides one GenerateSession call: a step's tokens for all of them arrive
        # in one message instead of one message per request.
        self._session = SessionClient(self._stub.GenerateSession)
        self._batches = BatchSessionClient(self._stub.BatchGenerateSession)  # fixed-batch calls, on one stream
        self._leases = SessionClient(self._stub.AcquireSession)  # every request's lease, on one call
        self._workers = WorkerSessions(tls)

    @property
    def streams_direct(self) -> bool:
        return self.stream_path == "direct" or (self.stream_path == "auto" and self.grants_leases)

    def generate(self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
                 ) -> RouterStream | DirectStream:
        """`metadata`: gRPC metadata for the calls (trace context, tier)."""
        if self.streams_direct:
            return DirectStream(self.acquire, self._workers, request, metadata)
        return RouterStream(self._session.generate(request, metadata))

    def acquire(self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()) -> SessionStream:
        """An Acquire stream on the router: its first event is the lease (or a refusal); ending it releases
        the lease. The one place that picks the router a lease comes from."""
        return self._leases.generate(request, metadata)

    async def batch_generate(self, call: router_pb2.BatchCall) -> router_pb2.BatchResult:
        return await self._batches.call(call)

    async def queue_load(self, models: Sequence[str]) -> router_pb2.GetQueueLoadResponse:
        return await self._stub.GetQueueLoad(router_pb2.GetQueueLoadRequest(models=models),
                                             timeout=self._list_timeout_s)

    async def list_models(self) -> list[common.ModelInfo]:
        response = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=self._list_timeout_s)
        self.grants_leases = response.grants_leases
        return list(response.models)

    async def get_model_assets(self, digest: str) -> dict[str, bytes]:
        call = self._stub.GetModelAssets(router_pb2.GetModelAssetsRequest(digest=digest), timeout=ASSETS_TIMEOUT_S)
        received, files = await receive_assets(call, MAX_TOTAL_BYTES)
        if received != digest:
            raise ValueError(f"asked for model assets {digest}, got {received}")
        return files

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once the channel is connected, False if it is not within `timeout_s` (the router is still down)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        self._session.close()
        self._leases.close()
        self._batches.close()
        await self._workers.close()
        await self._channel.close()
