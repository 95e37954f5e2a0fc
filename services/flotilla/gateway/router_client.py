"""The gateway's only way out: the router's Generate streams (on one session), its model list and the models'
tokenizer files, over grpc.aio. A stream's messages are decoded here, once each, into StreamEvents (rpc/convert.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.engine.tokenizer_files import MAX_TOTAL_BYTES
from flotilla.rpc.convert import stream_event
from flotilla.rpc.batch_session import BatchSessionClient
from flotilla.rpc.model_assets import receive_assets
from flotilla.rpc.options import aio_channel
from flotilla.rpc.tls import InternalTLS
from flotilla.rpc.session_client import SessionClient, SessionStream
from flotilla.rpc.stream_events import StreamEvent


ASSETS_TIMEOUT_S = 60.0  # tens of MB for the largest tokenizers


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
        following = self._call.next_ready()
        if following is not None:  # several arrived together: consecutive chunks leave as one
            if response.HasField("chunk"):
                while following is not None and following.HasField("chunk"):
                    merge_chunk(response.chunk, following.chunk)
                    following = self._call.next_ready()
            self._held = following
        return stream_event(response)

    async def aclose(self) -> None:
        self._call.cancel()


def merge_chunk(into: common.TokenChunk, following: common.TokenChunk) -> None:
    into.token_ids.extend(following.token_ids)
    into.text += following.text
    into.logprobs.extend(following.logprobs)


class RouterClient:
    """RouterService client. Closing a generate() iterator cancels the call, which aborts the request."""

    def __init__(self, address: str, list_timeout_s: float = 5.0, tls: InternalTLS | None = None):
        self.address = address
        self._list_timeout_s = list_timeout_s
        # keepalive finds a dead router; 64 MiB messages (long prompts)
        self._channel = aio_channel(address, tls, "router")
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        # Every request's stream rides one GenerateSession call: a step's tokens for all of them arrive
        # in one message instead of one message per request.
        self._session = SessionClient(self._stub.GenerateSession)
        self._batches = BatchSessionClient(self._stub.BatchGenerateSession)  # fixed-batch calls, on one stream

    def generate(self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()) -> RouterStream:
        """`metadata`: gRPC metadata for the call (trace context, tier)."""
        return RouterStream(self._session.generate(request, metadata))

    async def batch_generate(self, call: router_pb2.BatchCall) -> router_pb2.BatchResult:
        return await self._batches.call(call)

    async def queue_load(self, models: Sequence[str]) -> router_pb2.GetQueueLoadResponse:
        return await self._stub.GetQueueLoad(router_pb2.GetQueueLoadRequest(models=models),
                                             timeout=self._list_timeout_s)

    async def list_models(self) -> list[common.ModelInfo]:
        response = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=self._list_timeout_s)
        return list(response.models)

    async def get_model_assets(self, digest: str) -> dict[str, bytes]:
        call = self._stub.GetModelAssets(router_pb2.GetModelAssetsRequest(digest=digest), timeout=ASSETS_TIMEOUT_S)
        received, files = await receive_assets(call, MAX_TOTAL_BYTES)
        if received != digest:
            raise ValueError(f"asked for model assets {digest}, got {received}")
        return files

    async def close(self) -> None:
        self._session.close()
        self._batches.close()
        await self._channel.close()
