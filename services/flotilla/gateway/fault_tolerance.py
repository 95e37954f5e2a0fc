"""The gateway's fault-tolerance parts, opened together by the server: the usage ledger (whose tap on the router
stream is usage_meter.py), Idempotency-Key replays and resumable streams (ASGI middlewares around the app)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI

from flotilla.gateway.settings import GatewaySettings
from flotilla.usage.ledger import UsageLedger
from flotilla.usage.sinks import FileSink, RedisStreamSink

log = logging.getLogger(__name__)


@dataclass
class FaultTolerance:
    settings: GatewaySettings
    redis: object | None  # redis.asyncio.Redis, owned here
    ledger: UsageLedger | None

    @classmethod
    def open(cls, settings: GatewaySettings) -> FaultTolerance:
        """Call inside the running event loop (the ledger's writer task starts here)."""
        redis = None
        if settings.redis_url:
            from flotilla.tenancy.redis_conn import connect

            redis = connect(settings.redis_url)
        sink = RedisStreamSink(redis) if redis is not None else (
            FileSink(settings.usage_log) if settings.usage_log else None)
        if sink is None:
            log.warning("no Redis and no --usage-log: the usage ledger is off")
        return cls(settings, redis, UsageLedger(sink, checkpoint_interval_s=settings.usage_checkpoint_s).start() if sink is not None else None)

    def install(self, app: FastAPI) -> None:
        """Outermost middlewares (added after create_app's own): resumable streams, then idempotency."""
        from flotilla.gateway.idempotency import IdempotencyMiddleware, caller_check_for, open_store
        from flotilla.gateway.resumable import ResumableStreamMiddleware

        app.add_middleware(IdempotencyMiddleware, store=open_store(self.redis), ledger=self.ledger,
                           ttl_s=self.settings.idempotency_ttl_s, max_body_bytes=self.settings.max_body_bytes,
                           caller_check=caller_check_for(app))
        app.add_middleware(ResumableStreamMiddleware, grace_s=self.settings.stream_resume_grace_s,
                           max_body_bytes=self.settings.max_body_bytes)

    async def close(self) -> None:
        if self.ledger is not None:
            await self.ledger.close()
        if self.redis is not None:
            await self.redis.aclose()
