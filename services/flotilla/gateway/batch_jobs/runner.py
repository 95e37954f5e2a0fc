"""Runs batch jobs: takes a job's lease, validates it, runs its items at the tenant's batch concurrency, and
writes its results and final status; resumes whatever is left after a restart.

Every item is one call through the gateway's own app (dispatch.py) in the batch class, so the router places it
only while no interactive request waits and the engine preempts it first; its tokens are charged to the tenant's
quota and ledger at the batch rate of the owner's tier (settings.price_factor). A refusal that says "later"
(429, 503, 529; a 500 or 504 up to MAX_FAULTS times) is retried with backoff until the completion window ends;
any other answer is the item's result. `put_result` keeps the first result of an item, and an item with one is
never run again, so an item re-run after a crash is answered and counted once. The usage ledger is flushed
before a result is kept, so an answered item always has its record; one re-run after a crash has two, which
usage/summary.py counts once by (job, index).

Cancel and expiry cancel the items in flight (their router calls end, the engine aborts them); items without a
result become canceled/expired, and the answered ones stay: partial results.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp

from flotilla.gateway.auth import Principal
from flotilla.gateway.batch_jobs import openai_jsonl
from flotilla.gateway.batch_jobs.dispatch import call_app
from flotilla.gateway.batch_jobs.metrics import BatchMetrics
from flotilla.gateway.batch_jobs.records import (ANTHROPIC, CANCELED, CANCELLED, CANCELLING, COMPLETED,
                                                 ERRORED, EXPIRED, EXPIRED_ITEM, FAILED, FINALIZING, IN_PROGRESS,
                                                 OPENAI, SUCCEEDED, VALIDATING, BatchJob, ItemResult, StoredFile,
                                                 new_id)
from flotilla.gateway.batch_jobs.settings import BatchSettings
from flotilla.gateway.batch_jobs.store import BatchStore
from flotilla.gateway.dialects import Dialect, error_body
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.tenancy.records import Limits
from flotilla.usage.ledger import UsageLedger

log = logging.getLogger(__name__)

RETRY_ALWAYS = (429, 503, 529)
RETRY_FAULTS = (500, 504)
MAX_FAULTS = 3


@dataclass
class _Control:
    """How a running job is told to stop: cancelled (by its owner) or lost (its lease went to another gateway)."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    lost: bool = False


class BatchRunner:
    def __init__(self, store: BatchStore, settings: BatchSettings, metrics: BatchMetrics | None = None,
                 ledger: UsageLedger | None = None):
        self.store = store
        self.settings = settings
        self.metrics = metrics or BatchMetrics()
        self.ledger = ledger  # flushed before a result is kept: an answered item is always billed
        self.owner = new_id("gw_")  # this process, as a lease holder
        self._app: ASGIApp | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._controls: dict[str, _Control] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._resumer: asyncio.Task | None = None
        self._ready: Callable[[], bool] = lambda: True

    async def start(self, app: ASGIApp, ready: Callable[[], bool] = lambda: True) -> None:
        """`ready`: whether the gateway can serve yet (it knows the router's models); no item runs before."""
        self._app = app
        self._ready = ready
        self._resumer = asyncio.create_task(self._resume_forever(), name="batch-resumer")

    async def close(self) -> None:
        tasks = [t for t in (self._resumer, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def submit(self, job_id: str) -> None:
        """Runs the job here unless it already runs here (or, lease permitting, elsewhere)."""
        if job_id not in self._tasks and self._app is not None:
            self._tasks[job_id] = asyncio.create_task(self._run_job(job_id), name=f"batch-{job_id}")

    def cancel_local(self, job_id: str) -> None:
        """Stops the job at once if it runs here; elsewhere its runner sees `cancelling` at its next lease
        renewal."""
        control = self._controls.get(job_id)
        if control is not None:
            control.stop.set()

    async def _resume_forever(self) -> None:
        while True:
            try:
                for job_id in await self.store.active_job_ids():
                    self.submit(job_id)
            except Exception as err:  # noqa: BLE001 - the store is down: try again next period
                log.warning("batch jobs: cannot list active jobs: %s", err)
            await asyncio.sleep(self.settings.lease_ttl_s / 2)

    async def _run_job(self, job_id: str) -> None:
        control = self._controls[job_id] = _Control()
        keeper = None
        try:
            while not self._ready():  # a restarted gateway: its items would be 404s until the model list is in
                await asyncio.sleep(0.05)
            if not await self.store.acquire_lease(job_id, self.owner, self.settings.lease_ttl_s):
                return  # another gateway runs it; the resumer tries again if that one dies
            keeper = asyncio.create_task(self._keep_lease(job_id, control))
            await self._advance(job_id, control)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch job %s failed in this gateway; it is resumed later", job_id)
        finally:
            if keeper is not None:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
                if not control.lost:
                    await asyncio.shield(self.store.release_lease(job_id, self.owner))
            self._tasks.pop(job_id, None)
            self._controls.pop(job_id, None)

    async def _keep_lease(self, job_id: str, control: _Control) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_ttl_s / 3)
            if not await self.store.acquire_lease(job_id, self.owner, self.settings.lease_ttl_s):
                control.lost = True
                control.stop.set()
                return
            job = await self.store.get_job(job_id)
            if job is not None and job.status == CANCELLING:
                control.stop.set()

    async def _advance(self, job_id: str, control: _Control) -> None:
        job = await self.store.get_job(job_id)
        if job is None or not job.is_active:
            return
        if job.status == VALIDATING:
            job = await self._validate(job)
            if job.status == FAILED:
                return
        items = await self.store.get_items(job.id)
        ending = COMPLETED
        if job.status == FINALIZING:  # resumed: it ended before the crash; how, its results say
            ending = EXPIRED if (await self.store.result_counts(job.id)).get(EXPIRED_ITEM) else COMPLETED
        if job.status == IN_PROGRESS:
            ending = await self._process(job, items, control)
            if control.lost:
                return
        current = await self.store.get_job(job.id)
        if current is not None and current.status == CANCELLING:
            ending = CANCELLED
        await self._finish(current or job, items, ending)

    async def _validate(self, job: BatchJob) -> BatchJob:
        content = await self.store.file_content(job.input_file_id)
        now = time.time()
        if content is None:
            items, errors = [], [{"code": "file_not_found", "message": f"file {job.input_file_id} was deleted",
                                  "param": "input_file_id", "line": None}]
        else:
            items, errors = openai_jsonl.parse_input(content, job.endpoint, self.settings.max_requests,
                                                     self.settings.max_line_bytes)
        if errors:
            job.errors = errors
            job.enter(FAILED, now)
        else:
            await self.store.put_items(job.id, items)
            job.num_items = len(items)
            job.enter(IN_PROGRESS, now)
        current = await self.store.get_job(job.id)
        if current is not None and current.status == CANCELLING:  # cancelled while validating
            job.status, job.times = CANCELLING, current.times
        await self.store.put_job(job)
        return job

    async def _process(self, job: BatchJob, items: list[dict], control: _Control) -> str:
        """Runs every item without a result; returns how the job ended: COMPLETED, CANCELLED or EXPIRED."""
        done = set(await self.store.get_results(job.id))
        slots = self._slots.setdefault(job.tenant, asyncio.Semaphore(self.settings.concurrency_per_tenant))
        running: set[asyncio.Task] = set()

        def finished(task: asyncio.Task) -> None:
            running.discard(task)
            slots.release()
            self.metrics.in_flight.dec()
            if not task.cancelled() and task.exception() is not None:  # the store failed: the item runs again later
                log.warning("batch job %s: an item failed to run: %r", job.id, task.exception())

        async def feed() -> None:
            for index, item in enumerate(items):
                if index not in done and not control.stop.is_set():
                    await slots.acquire()
                    task = asyncio.create_task(self._run_item(job, index, item))
                    self.metrics.in_flight.inc()
                    running.add(task)
                    task.add_done_callback(finished)
            while running:
                await asyncio.wait(set(running))

        feeder = asyncio.create_task(feed())
        stopper = asyncio.create_task(control.stop.wait())
        try:
            await asyncio.wait({feeder, stopper}, timeout=max(0.0, job.expires_at - time.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not feeder.done():
                feeder.cancel()
                for task in list(running):
                    task.cancel()
            await asyncio.gather(feeder, stopper, *running, return_exceptions=True)
        if control.stop.is_set():
            return CANCELLED
        if not feeder.cancelled() and feeder.exception() is None:
            counts = await self.store.result_counts(job.id)
            if sum(counts.values()) < len(items):
                raise RuntimeError(f"{len(items) - sum(counts.values())} items of {job.id} failed to run")
            return COMPLETED
        return EXPIRED

    async def _run_item(self, job: BatchJob, index: int, item: dict) -> None:
        owner = job.owner
        principal = Principal(owner.key_id, owner.tenant, owner.tier, "batch", Limits(**owner.limits),
                              owner.cache_salt, batch_item=(job.id, index), safety_policy=owner.safety_policy,
                              price_factor=self.settings.price_factor(owner.tier))
        body = item["body"]
        if body.get("stream"):
            dialect = Dialect.ANTHROPIC if job.dialect == ANTHROPIC else Dialect.OPENAI
            error = GatewayError(ErrorKind.INVALID_REQUEST, "stream is not supported in a batch", param="stream")
            await self._put_result(job.id, index, ItemResult(ERRORED, 400, error_body(dialect, error)))
            return
        payload = json.dumps(body).encode()
        delay, faults = self.settings.retry_s, 0
        while True:
            response = await call_app(self._app, principal, job.endpoint, payload)
            faults += response.status in RETRY_FAULTS
            if response.status not in RETRY_ALWAYS and not (response.status in RETRY_FAULTS
                                                            and faults < MAX_FAULTS):
                break
            self.metrics.retries.labels(str(response.status)).inc()
            await asyncio.sleep(min(max(delay, _retry_after_s(response.headers)), self.settings.max_retry_s))
            delay = min(delay * 2, self.settings.max_retry_s)
        if self.ledger is not None:  # a crash after this re-runs the item: billed twice, deduplicated by summary
            await self.ledger.flush()
        kind = SUCCEEDED if 200 <= response.status < 300 else ERRORED
        await self._put_result(job.id, index, ItemResult(kind, response.status, response.json(),
                                                   response.headers.get("x-request-id", "")))

    async def _put_result(self, job_id: str, index: int, result: ItemResult) -> None:
        if await self.store.put_result(job_id, index, result):
            self.metrics.results.labels(result.type).inc()

    async def _finish(self, job: BatchJob, items: list[dict], ending: str) -> None:
        if ending != COMPLETED:
            results = await self.store.get_results(job.id)
            unanswered = ItemResult(CANCELED if ending == CANCELLED else EXPIRED_ITEM)
            for index in range(len(items)):
                if index not in results:
                    await self._put_result(job.id, index, unanswered)
        now = time.time()
        if ending != CANCELLED:
            job.enter(FINALIZING, now)
            await self.store.put_job(job)
        if job.dialect == OPENAI:
            await self._write_files(job, items)
        job.enter(ending, time.time())
        await self.store.put_job(job)

    async def _write_files(self, job: BatchJob, items: list[dict]) -> None:
        """Ids follow from the job's, so finalizing again after a crash rewrites the same files."""
        output, errors = openai_jsonl.output_lines(job, items, await self.store.get_results(job.id))
        stem = job.id.removeprefix("batch_")
        for content, suffix, attribute in ((output, "output", "output_file_id"), (errors, "error", "error_file_id")):
            if content:
                file_id = f"file-{stem}{suffix}"
                meta = StoredFile(file_id, job.tenant, f"{job.id}_{suffix}.jsonl", "batch_output", len(content),
                                  time.time())
                await self.store.put_file(meta, content)
                setattr(job, attribute, file_id)


def _retry_after_s(headers: dict[str, str]) -> float:
    try:
        return float(headers.get("retry-after", "0"))
    except ValueError:
        return 0.0
