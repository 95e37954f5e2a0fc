"""Several routers behind the gateway's one RouterBackend: which router a model's requests go to, and what
happens when that router is gone.

Each model name is owned by one router at a time: the routers are ranked per model by rendezvous hashing of
(router address, model name) (rpc/router_ownership.py), the same ranking in every gateway that was given the same
addresses, so that one router holds a model's queues and its tenants' fair shares. A router a call was lost
with (LOST_ROUTER_STATUSES), or that did not answer the last probe (ListModels every probe_interval_s), ranks last
until a probe reaches it again; a router that answers but does not list the model (it restarted and its workers
have not registered again yet) ranks after those that do. A stream lost with its router is re-submitted to the
next one (router_resume.py).

`routers_for(model)` / `router_for(model)` are the seam for code that talks to the router itself (placement);
generate, batch_generate, list_models and get_model_assets are the RouterBackend the app uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.api.router.v1 import router_pb2
from flotilla.gateway.direct_stream import DirectStream, WorkerSessions
from flotilla.gateway.router_client import RouterClient
from flotilla.gateway.router_resume import ResumingStream
from flotilla.rpc.router_ownership import rendezvous_score
from flotilla.rpc.session_client import SessionStream
from flotilla.rpc.tls import InternalTLS

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0
# A call that failed with these lost its router (killed, restarting, shut down under the call). INTERNAL is what
# gRPC core gives a session call whose write met the dead connection ("Failed execute_batch").
LOST_ROUTER_STATUSES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL})
# When every router failed a call, how long to wait for one to take connections again before the client gets 503:
# a router brought back at its address is dialled again within rpc/options.py's 2 s reconnect backoff, so a short
# restart costs the requests that arrive meanwhile a few seconds of latency, not an error.
RECONNECT_GRACE_S = 3.0


@dataclass(eq=False)
class _Router:
    client: RouterClient
    down: bool = False  # a call lost the router (LOST_ROUTER_STATUSES) or the last probe did not answer
    models: frozenset[str] | None = None  # names (and aliases) it listed last; None: not asked yet


class RouterPool:
    def __init__(self, addresses: Sequence[str], list_timeout_s: float = 5.0, tls: InternalTLS | None = None,
                 probe_interval_s: float = PROBE_INTERVAL_S, stream_path: str = "auto",
                 reconnect_grace_s: float = RECONNECT_GRACE_S):
        if not addresses:
            raise ValueError("the gateway needs at least one router address")
        self._routers = [_Router(RouterClient(address, list_timeout_s, tls, stream_path)) for address in addresses]
        self._workers = WorkerSessions(tls)  # the lease path's worker sessions, whichever router placed
        self._by_client = {router.client: router for router in self._routers}
        self._aliases: dict[str, str] = {}  # alias -> model name, from the last model lists
        self._probe_interval_s = probe_interval_s
        self._reconnect_grace_s = reconnect_grace_s
        self._prober: asyncio.Task | None = None

    # ---- the seam: which router serves a model -------------------------------------------------------
    def routers_for(self, model: str) -> list[RouterClient]:
        """Every router, the one that owns `model` first, then the one to fail over to, and so on."""
        self._start_probing()
        name = self.model_name(model)

        def rank(router: _Router) -> tuple[bool, bool, int]:
            listed = router.models is None or name in router.models
            return router.down, not listed, -rendezvous_score(router.client.address, name)

        return [router.client for router in sorted(self._routers, key=rank)]

    def router_for(self, model: str) -> RouterClient:
        return self.routers_for(model)[0]

    def model_name(self, requested: str) -> str:
        """The model name a request's model field stands for (its alias resolved, a version pin dropped): the
        key its router is chosen by, so that a model's aliases and versions share one queue."""
        name = requested.partition("@")[0]
        return self._aliases.get(name, name)

    def mark_unreachable(self, client: RouterClient) -> None:
        """A call to `client` lost its router: rank it last until a probe reaches it again."""
        router = self._by_client[client]
        if not router.down:
            log.warning("router %s unreachable; failing over", client.address)
        router.down = True

    async def attempt_order(self, model: str) -> AsyncIterator[RouterClient]:
        """The routers a call for `model` tries, in routers_for order; when the caller has come back for more
        (every one failed), the same again once one of them is connected again (wait_reconnected)."""
        for client in self.routers_for(model):
            yield client
        if await self.wait_reconnected(model):
            for client in self.routers_for(model):
                yield client

    async def wait_reconnected(self, model: str) -> bool:
        """Every router failed: True once one of them (the model's owner first) is connected again, False if none
        is within the reconnect grace, or at once when none is marked unreachable (waiting would change nothing)."""
        if not any(router.down for router in self._routers):
            return False
        waits = [asyncio.ensure_future(client.wait_ready(self._reconnect_grace_s))
                 for client in self.routers_for(model)]
        try:
            for done in asyncio.as_completed(waits):
                if await done:
                    return True
            return False
        finally:
            for wait in waits:
                wait.cancel()

    def on_call_error(self, client: RouterClient, err: grpc.RpcError) -> bool:
        """True when `err` means the router, not the request, failed; then it is marked unreachable, whichever
        of LOST_ROUTER_STATUSES said so (a write that met the dead connection is INTERNAL, not UNAVAILABLE, and
        wait_reconnected only waits for routers marked down)."""
        lost = hasattr(err, "code") and err.code() in LOST_ROUTER_STATUSES
        if lost:
            self.mark_unreachable(client)
        return lost

    # ---- RouterBackend --------------------------------------------------------------------------------
    def generate(self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
                 ) -> ResumingStream | DirectStream:
        """The lease path when the model's router grants leases: the stream comes from the worker, so a router
        lost after placement costs it nothing, and one lost while the request queues there is acquired from the
        next (FailoverAcquire). Else the relay path, re-submitted to the next router when its router is lost."""
        if self.router_for(request.model).streams_direct:
            return DirectStream(self.acquire, self._workers, request, metadata)
        return ResumingStream(self, request, metadata, max_attempts=len(self._routers) + 1)

    def acquire(self, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()) -> FailoverAcquire:
        return FailoverAcquire(self, request, metadata)

    async def batch_generate(self, call: router_pb2.BatchCall) -> router_pb2.BatchResult:
        last_error: grpc.RpcError | None = None
        async for client in self.attempt_order(call.model):
            try:
                return await client.batch_generate(call)
            except grpc.RpcError as err:
                if not self.on_call_error(client, err):
                    raise
                last_error = err
        raise last_error

    async def queue_load(self, models: Sequence[str]) -> router_pb2.GetQueueLoadResponse:
        """Each model's backlog from the router that owns it (its queue is there); a model whose owner does not
        answer is left out (the poller reads that as no signal: nothing is degraded)."""
        by_owner: dict[RouterClient, list[str]] = {}
        for model in models:
            by_owner.setdefault(self.router_for(model), []).append(model)
        answers = await asyncio.gather(*(client.queue_load(names) for client, names in by_owner.items()),
                                       return_exceptions=True)
        merged = router_pb2.GetQueueLoadResponse()
        for client, answer in zip(by_owner, answers):
            if isinstance(answer, grpc.RpcError):
                self.on_call_error(client, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                merged.models.extend(answer.models)
        return merged

    async def list_models(self) -> list[common.ModelInfo]:
        """Every router's list, each model name as its owning router lists it (its current version first); raises
        the first router's error when none answers."""
        listings = await self._list_all()
        if not any(isinstance(listing, list) for listing in listings.values()):
            raise next(iter(listings.values()))
        by_router = {router: listing for router, listing in listings.items() if isinstance(listing, list)}
        models = []
        for name in sorted({info.name for listing in by_router.values() for info in listing}):
            owner = next(client for client in self.routers_for(name)
                         if any(info.name == name for info in by_router.get(self._by_client[client], ())))
            models += [info for info in by_router[self._by_client[owner]] if info.name == name]
        return models

    async def get_model_assets(self, digest: str) -> dict[str, bytes]:
        last_error: Exception | None = None
        for router in sorted(self._routers, key=lambda r: r.down):
            try:
                return await router.client.get_model_assets(digest)
            except (grpc.RpcError, ValueError) as err:
                last_error = err
        raise last_error

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        for router in self._routers:
            await router.client.close()
        await self._workers.close()

    # ---- health ---------------------------------------------------------------------------------------
    async def _list_all(self) -> dict[_Router, list[common.ModelInfo] | BaseException]:
        answers = await asyncio.gather(*(router.client.list_models() for router in self._routers),
                                       return_exceptions=True)
        for router, answer in zip(self._routers, answers):
            self._note_listing(router, answer)
        return dict(zip(self._routers, answers))

    def _note_listing(self, router: _Router, answer: list[common.ModelInfo] | BaseException) -> None:
        if isinstance(answer, BaseException):
            if not router.down:
                log.warning("router %s did not answer: %s", router.client.address, answer)
            router.down = True
            return
        if router.down:
            log.info("router %s reachable again", router.client.address)
        router.down = False
        router.models = frozenset(info.name for info in answer) | {a for info in answer for a in info.aliases}
        for info in answer:
            self._aliases.update((alias, info.name) for alias in info.aliases)

    def _start_probing(self) -> None:
        """The first caller in an event loop starts the probe (nothing to probe with one router)."""
        if self._prober is None and len(self._routers) > 1:
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(router) for router in self._routers))
            await asyncio.sleep(self._probe_interval_s)  # a periodic probe, not a wait for something

    async def _probe(self, router: _Router) -> None:
        try:
            answer = await asyncio.wait_for(router.client.list_models(), PROBE_TIMEOUT_S)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            answer = err
        self._note_listing(router, answer)


class FailoverAcquire:
    """An Acquire stream on the model's router that moves to the next router when its router is lost before it
    answered (the request was queued there): the lease stream DirectStream reads (its first event, then
    `cancel(report)` to release the lease)."""

    def __init__(self, pool: RouterPool, request: common.GenerateRequest, metadata: Sequence[tuple[str, str]]):
        self._pool = pool
        self._request = request
        self._metadata = metadata
        self._call: SessionStream | None = None

    def __aiter__(self) -> FailoverAcquire:
        return self

    async def __anext__(self) -> common.GenerateResponse:
        if self._call is not None:
            return await self._call.__anext__()
        last_error: grpc.aio.AioRpcError | None = None
        async for client in self._pool.attempt_order(self._request.model):
            self._call = client.acquire(self._request, self._metadata)
            try:
                return await self._call.__anext__()
            except grpc.aio.AioRpcError as err:
                if not self._pool.on_call_error(client, err):
                    raise
                last_error = err
        assert last_error is not None
        raise last_error

    def cancel(self, report: common.StreamReport | None = None) -> bool:
        return self._call.cancel(report) if self._call is not None else False
