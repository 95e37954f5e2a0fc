"""Keeps a worker registered with the router: register, send the model's tokenizer files when the router asks
(gateways read them from it), heartbeat with a LoadReport every interval, register again when the router says
it does not know us (it restarted or dropped us), deregister on stop. With several routers (RouterLinks) the
worker does all of it with each of them on its own: every router's registry is rebuilt from the workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

import grpc

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.rpc.model_assets import asset_chunks
from flotilla.rpc.options import aio_channel
from flotilla.rpc.tls import InternalTLS

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 2.0
PUBLISH_TIMEOUT_S = 30.0  # tens of MB for the largest tokenizers


class RouterLink:
    def __init__(
        self,
        router_address: str,
        worker: rpb.WorkerInfo,
        current_load: Callable[[], pb.LoadReport],
        heartbeat_interval_s: float = 0.25,
        tokenizer_files: Mapping[str, bytes] | None = None,
        tls: InternalTLS | None = None,
        shared_assets: Mapping[str, Mapping[str, bytes]] | None = None,  # digest -> files (shared-pool worker)
    ):
        self._channel = aio_channel(router_address, tls, "router")
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._worker = worker
        self._current_load = current_load
        self._interval_s = heartbeat_interval_s
        self._tokenizer_files = tokenizer_files or {}
        self._shared_assets = shared_assets or {}
        self._registered = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # report_now: heartbeat before the interval is up

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop heartbeating and leave the router (best effort: it drops us after missed heartbeats anyway)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.DeregisterWorker(
                rpb.DeregisterWorkerRequest(worker_id=self._worker.worker_id), timeout=CALL_TIMEOUT_S
            )
        await self._channel.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except grpc.aio.AioRpcError as exc:  # router down or restarting: keep trying
                logger.debug("router call failed: %s", exc.code())
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # the interval, or sooner on report_now
                await asyncio.wait_for(self._wake.wait(), self._interval_s)

    def report_now(self) -> None:
        """Send the next heartbeat at once (a shared-pool worker loaded or unloaded a model)."""
        self._wake.set()

    async def _tick(self) -> None:
        if self._registered:
            response = await self._stub.Heartbeat(
                rpb.HeartbeatRequest(worker_id=self._worker.worker_id, load=self._current_load()),
                timeout=CALL_TIMEOUT_S,
            )
            if response.known:
                return
            logger.info("router does not know this worker any more; registering again")
            self._registered = False
        await self._register()

    async def _register(self) -> None:
        response = await self._stub.RegisterWorker(
            rpb.RegisterWorkerRequest(worker=self._worker), timeout=CALL_TIMEOUT_S
        )
        if response.heartbeat_interval_ms > 0:
            self._interval_s = response.heartbeat_interval_ms / 1000
        if response.send_model_assets:
            await self._publish_tokenizer_files()
        for digest in response.send_assets_digests:
            if digest in self._shared_assets:
                await self._stub.PublishModelAssets(asset_chunks(digest, self._shared_assets[digest]),
                                                    timeout=PUBLISH_TIMEOUT_S)
        self._registered = True
        logger.info("registered with the router as %s", self._worker.worker_id)
        # Report load at once, so that the router does not wait an interval to place work here.
        await self._stub.Heartbeat(
            rpb.HeartbeatRequest(worker_id=self._worker.worker_id, load=self._current_load()),
            timeout=CALL_TIMEOUT_S,
        )

    async def _publish_tokenizer_files(self) -> None:
        # A failure raises before we count as registered: the next tick registers and publishes again.
        chunks = asset_chunks(self._worker.model.assets_digest, self._tokenizer_files)
        await self._stub.PublishModelAssets(chunks, timeout=PUBLISH_TIMEOUT_S)
        logger.info("sent the model's tokenizer files to the router")


class RouterLinks:
    """One RouterLink per router: each registers, reports and re-registers on its own, so that a router that is
    down or restarting delays none of the others."""

    def __init__(self, router_addresses: Sequence[str], worker: rpb.WorkerInfo,
                 current_load: Callable[[], pb.LoadReport], heartbeat_interval_s: float = 0.25,
                 tokenizer_files: Mapping[str, bytes] | None = None, tls: InternalTLS | None = None,
                 shared_assets: Mapping[str, Mapping[str, bytes]] | None = None):
        self.links = [RouterLink(address, worker, current_load, heartbeat_interval_s, tokenizer_files, tls,
                                 shared_assets) for address in router_addresses]

    def start(self) -> None:
        for link in self.links:
            link.start()

    def report_now(self) -> None:
        for link in self.links:
            link.report_now()

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.links))
