"""The batch-job service of one gateway app: its store, its runner, its limits (app.state.batch_jobs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.types import ASGIApp

from flotilla.gateway.auth import Principal
from flotilla.gateway.batch_jobs.records import (CANCELLING, IN_PROGRESS, VALIDATING, BatchJob, JobOwner,
                                                 StoredFile)
from flotilla.gateway.batch_jobs.metrics import BatchMetrics
from flotilla.gateway.batch_jobs.runner import BatchRunner
from flotilla.gateway.batch_jobs.settings import BatchSettings
from flotilla.gateway.batch_jobs.sqlite_store import SQLiteBatchStore
from flotilla.gateway.batch_jobs.store import BatchStore
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.usage.ledger import UsageLedger


@dataclass
class BatchJobs:
    store: BatchStore
    runner: BatchRunner
    settings: BatchSettings
    owns_store: bool

    @classmethod
    def create(cls, settings: BatchSettings, store: BatchStore | None = None,
               registry: CollectorRegistry | None = None, ledger: UsageLedger | None = None) -> BatchJobs:
        """`store` (Redis) is the caller's to close; without one, SQLite in settings.state_file (or memory).
        Metrics go to `registry` (the gateway's); `ledger` is the gateway's usage ledger."""
        owns_store = store is None
        if store is None:
            store = SQLiteBatchStore(settings.state_file or ":memory:")
        return cls(store, BatchRunner(store, settings, BatchMetrics(registry), ledger), settings, owns_store)

    async def start(self, app: ASGIApp, ready: Callable[[], bool]) -> None:
        await self.runner.start(app, ready)

    async def close(self) -> None:
        await self.runner.close()
        if self.owns_store:
            await self.store.close()

    async def owned_job(self, job_id: str, principal: Principal, dialect: str, what: str) -> BatchJob:
        """The caller's job; another tenant's is as unknown as a missing one (404)."""
        job = await self.store.get_job(job_id)
        if job is None or job.tenant != principal.tenant or job.dialect != dialect:
            raise GatewayError(ErrorKind.NOT_FOUND, f"no {what} with id {job_id!r}", param="batch_id")
        return job

    async def owned_file(self, file_id: str, principal: Principal) -> StoredFile:
        meta = await self.store.get_file(file_id)
        if meta is None or meta.tenant != principal.tenant:
            raise GatewayError(ErrorKind.NOT_FOUND, f"no file with id {file_id!r}", param="file_id")
        return meta

    def new_job(self, job_id: str, dialect: str, principal: Principal, endpoint: str, **fields) -> BatchJob:
        now = time.time()
        owner = JobOwner(principal.key_id, principal.tenant, principal.tier, asdict(principal.limits),
                         principal.cache_salt, principal.safety_policy)
        return BatchJob(job_id, dialect, owner, endpoint, now, now + self.settings.completion_window_s,
                        times={}, **fields)

    async def start_job(self, job: BatchJob) -> None:
        job.times.setdefault(job.status, job.created_at)
        await self.store.put_job(job)
        self.runner.submit(job.id)

    async def cancel(self, job: BatchJob) -> BatchJob:
        """validating or in_progress -> cancelling; the runner (here, or the lease holder elsewhere) cancels the
        items in flight and ends the job as cancelled. A job already cancelling or ended is left as it is."""
        if job.status in (VALIDATING, IN_PROGRESS):
            job.enter(CANCELLING, time.time())
            await self.store.put_job(job)
            self.runner.cancel_local(job.id)
            self.runner.submit(job.id)  # ends it here if no gateway runs it
        return job


def batch_jobs(request: Request) -> BatchJobs:
    return request.app.state.batch_jobs
