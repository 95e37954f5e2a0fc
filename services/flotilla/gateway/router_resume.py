"""A request's router stream that survives the router: when the call fails because its router went away
(UNAVAILABLE, CANCELLED under it), the request is submitted again to the next router of the pool, as the router's
own failover does for a lost worker (router/failover.py):
- nothing received yet: the same request again (it may have been queued on the dead router);
- tokens received: prompt + those tokens, `num_previous_output_tokens` advanced and max_tokens reduced, so that the
  worker the new router picks prefills them, continues the sampler's seeds at that index and holds back the same
  text; the caller sees no seam. Usage on the last event is the caller's prompt and every token it got.
Routers the request was lost on are skipped while another remains. Attempts are bounded (the pool's routers + 1);
then the last call error is raised, as a single router's would be.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.request import FinishReason
from flotilla.gateway.router_client import RouterClient, RouterStream
from flotilla.rpc.stream_events import Chunk, Error, Finished, StreamEvent, Usage

if TYPE_CHECKING:
    from flotilla.gateway.router_pool import RouterPool

log = logging.getLogger(__name__)


class ResumingStream:
    def __init__(self, pool: RouterPool, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]],
                 max_attempts: int):
        self._pool = pool
        self._request = request
        self._metadata = metadata
        self._max_attempts = max_attempts
        self._delivered: list[int] = []
        self._lost_on: list[RouterClient] = []
        self._router: RouterClient | None = None
        self._stream: RouterStream | None = None
        self._last_error: grpc.RpcError | None = None
        self._closed = False

    def __aiter__(self) -> ResumingStream:
        return self

    async def __anext__(self) -> StreamEvent:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._stream is None:
                if self._lost_on and not await self._another_router_or_one_back():
                    raise self._last_error
                self._open()
            try:
                event = await self._stream.__anext__()
            except grpc.RpcError as err:
                if not self._lost_router(err):
                    raise
                if self._complete():
                    return self._finished_here()
                continue
            if type(event) is Chunk:
                self._delivered.extend(event.token_ids)
                return event
            return self._as_callers(event)

    async def aclose(self) -> None:
        self._closed = True
        if self._stream is not None:
            await self._stream.aclose()

    def _open(self) -> None:
        candidates = self._pool.routers_for(self._request.model)
        router = next((c for c in candidates if c not in self._lost_on), candidates[0])
        self._router = router
        self._stream = router.generate(self._attempt(), self._metadata)

    async def _another_router_or_one_back(self) -> bool:
        """True when a router it was not lost on is there, or one it was lost on takes connections again."""
        candidates = self._pool.routers_for(self._request.model)
        if any(c not in self._lost_on for c in candidates):
            return True
        return await self._pool.wait_reconnected(self._request.model)

    def _attempt(self) -> common.GenerateRequest:
        if not self._delivered:
            return self._request
        attempt = common.GenerateRequest()
        attempt.CopyFrom(self._request)
        attempt.prompt_token_ids.extend(self._delivered)
        attempt.num_previous_output_tokens = self._request.num_previous_output_tokens + len(self._delivered)
        attempt.sampling.max_tokens = self._request.sampling.max_tokens - len(self._delivered)
        return attempt

    def _lost_router(self, err: grpc.RpcError) -> bool:
        """True when the request goes on elsewhere (the router, not the request, failed, and attempts remain)."""
        router, self._stream, self._last_error = self._router, None, err
        if not self._pool.on_call_error(router, err):
            return False
        self._lost_on.append(router)
        if len(self._lost_on) >= self._max_attempts and not self._complete():
            log.warning("request %s lost on %d routers; giving up", self._request.request_id, len(self._lost_on))
            return False
        log.warning("request %s lost with router %s (%s) after %d tokens; submitting it again",
                    self._request.request_id, router.address, err.code().name, len(self._delivered))
        return True

    def _complete(self) -> bool:
        """Every token it may have was received: only the last event was lost with the router."""
        return len(self._delivered) >= self._request.sampling.max_tokens > 0

    def _finished_here(self) -> Finished:
        self._closed = True
        return Finished(FinishReason.LENGTH, Usage(len(self._request.prompt_token_ids), len(self._delivered), 0),
                        num_attempts=len(self._lost_on))

    def _as_callers(self, event: StreamEvent) -> StreamEvent:
        """The last event, counted as the caller's request: its own prompt, every token, every attempt. The
        stream is kept: aclose() tells its router it is done with it."""
        self._closed = True
        if not self._lost_on:
            return event
        attempts = len(self._lost_on) + event.num_attempts
        if type(event) is Error:
            return replace(event, num_attempts=attempts)
        num_prompt = len(self._request.prompt_token_ids)
        usage = Usage(num_prompt, len(self._delivered), min(event.usage.cached_prompt_tokens, num_prompt))
        return replace(event, usage=usage, num_attempts=attempts)
