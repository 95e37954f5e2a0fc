"""The gateway in this process: the real app on real uvicorn, in front of a fake router (real grpc.aio), on free
loopback ports, in one background thread with one event loop, so that the tests themselves are plain
synchronous functions using the real SDKs. (The gateway as a process, with a real router: tests/support/fleet.py.)
With `redis_url` quotas and batch jobs are in that Redis, as `flotilla gateway --redis-url` keeps them (keys stay in
the keys file)."""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import uvicorn

from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.gateway.app import create_app
from flotilla.gateway.batch_jobs.redis_store import RedisBatchStore
from flotilla.tenancy.keys import KeyEntry, KeyStore, generate_key, hash_key, write_keys_file
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.router_pool import RouterPool
from flotilla.gateway.server import uvicorn_config
from flotilla.gateway.settings import GatewaySettings
from flotilla.tenancy.gatekeeper import Gatekeeper
from flotilla.tenancy.records import Limits
from flotilla.tenancy.redis_conn import connect
from flotilla.tenancy.redis_quota import RedisQuotaStore
from flotilla.usage.ledger import UsageLedger
from flotilla.observability.exposition import serve_metrics

from tests.support.waiting import wait_until

from .fake_router import FakeRouter

START_TIMEOUT_S = 20.0
MAX_BODY_BYTES = 64 * 1024


class InProcessGateway:
    def __init__(self, checkpoint_path: Path, keys_dir: Path, ledger_sink=None, **settings):
        """`settings`: GatewaySettings fields over the defaults below; `ledger_sink`: a UsageSink the app's
        UsageLedger writes to (None: no ledger)."""
        self.fake = FakeRouter(str(checkpoint_path))
        self.ledger_sink = ledger_sink  # a usage_sinks.UsageSink: the app gets a UsageLedger writing to it
        self.paid_key, self.free_key, self.batch_key = generate_key(), generate_key(), generate_key()
        self.metered_key = generate_key()  # the one key with a token quota (tenant "metered")
        self.keys_file = keys_dir / "keys.json"
        write_keys_file(self.keys_file, [KeyEntry("k-paid", hash_key(self.paid_key), "acme", "paid"),
                                         KeyEntry("k-free", hash_key(self.free_key), "hobbyist", "free"),
                                         KeyEntry("k-batch", hash_key(self.batch_key), "acme", "paid",
                                                  priority_class="batch"),
                                         KeyEntry("k-metered", hash_key(self.metered_key), "metered", "paid",
                                                  limits=Limits(tokens_per_minute=1_000_000))])
        self.settings = GatewaySettings(keys_file=self.keys_file, max_body_bytes=MAX_BODY_BYTES,
                                        model_refresh_s=3600.0, min_refresh_gap_s=0.0, retry_after_s=7,
                                        **settings)
        self.metrics = GatewayMetrics()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server: uvicorn.Server | None = None
        self._metrics_server = serve_metrics(self.metrics.registry, "127.0.0.1", 0)  # as `--metrics-port 0`
        self.metrics_url = f"http://127.0.0.1:{self._metrics_server.port}/metrics"
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="in-process-gateway", daemon=True)

    def start(self) -> InProcessGateway:
        self._thread.start()

        def started() -> bool:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"gateway did not start: {self._error!r}")
            return self._server is not None and self._server.started

        wait_until(started, START_TIMEOUT_S, "the in-process gateway to serve")
        return self

    def app_state(self):
        """The app's GatewayContext (read from the tests' thread: counters only)."""
        return self.app.state.gateway

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=10)
        self._metrics_server.stop()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as err:  # surfaced by start()
            self._error = err

    async def _serve(self) -> None:
        grpc_server = grpc.aio.server()
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.fake, grpc_server)
        router_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        self.settings = replace(self.settings, router_addresses=(f"127.0.0.1:{router_port}",))
        client = RouterPool(self.settings.router_addresses)
        ledger = self.ledger = UsageLedger(self.ledger_sink).start() if self.ledger_sink is not None else None
        keys, gatekeeper, batch_store = KeyStore.from_file(self.keys_file), None, None
        if self.settings.redis_url:
            redis = connect(self.settings.redis_url)
            gatekeeper = self.gatekeeper = Gatekeeper(keys.as_async(), RedisQuotaStore(redis), redis)
            batch_store = RedisBatchStore(redis)
        app = create_app(self.settings, client, keys, metrics=self.metrics, ledger=ledger, gatekeeper=gatekeeper,
                         batch_store=batch_store)
        self.app = app
        config = uvicorn_config(app, self.settings, log_level="warning", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            if ledger is not None:
                await ledger.close()
            if gatekeeper is not None:
                await gatekeeper.close()  # and its Redis client, the batch store's too
            await client.close()
            await grpc_server.stop(0)
