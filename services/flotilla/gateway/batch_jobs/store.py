"""The batch store's contract, shared by its Redis (redis_store.py) and SQLite (sqlite_store.py) backends.

Everything a job needs to survive a gateway restart: uploaded and produced files, jobs, their items, one result
per item. `put_result` keeps the first result of an (job, index) and reports whether it was that first: the
one rule that makes an item count once however often it ran. A lease names the one gateway running a job.
Files are listed per tenant from an index ordered by (created_at, id), never by reading every file.
"""

from __future__ import annotations

from typing import Protocol

from flotilla.gateway.batch_jobs.records import BatchJob, ItemResult, StoredFile


class UnknownCursor(LookupError):
    """A listing's `after` names no file of that listing (the tenant's, of the purpose asked for)."""


class BatchStore(Protocol):
    async def put_file(self, meta: StoredFile, content: bytes) -> None: ...

    async def get_file(self, file_id: str) -> StoredFile | None: ...

    async def file_content(self, file_id: str) -> bytes | None: ...

    async def delete_file(self, file_id: str) -> bool: ...

    async def list_files(self, tenant: str, purpose: str | None, descending: bool, after: str | None,
                         limit: int) -> tuple[list[StoredFile], bool]:
        """Up to `limit` of the tenant's files (of `purpose`, or all), by (created_at, id), after the file
        `after`; and whether more follow. Raises UnknownCursor when `after` is not in that listing."""

    async def put_job(self, job: BatchJob) -> None:
        """Creates or replaces the job (the active set follows job.is_active)."""

    async def get_job(self, job_id: str) -> BatchJob | None: ...

    async def list_jobs(self, tenant: str, dialect: str) -> list[BatchJob]:
        """The tenant's jobs of one dialect, newest first."""

    async def active_job_ids(self) -> list[str]: ...

    async def put_items(self, job_id: str, items: list[dict]) -> None: ...

    async def get_items(self, job_id: str) -> list[dict]: ...

    async def put_result(self, job_id: str, index: int, result: ItemResult) -> bool:
        """Keeps `result` unless the item has one already; True when this one was kept."""

    async def get_results(self, job_id: str) -> dict[int, ItemResult]: ...

    async def result_counts(self, job_id: str) -> dict[str, int]:
        """Number of results by type (records.RESULT_TYPES)."""

    async def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        """Takes the job's lease, or renews it when `owner` holds it; False while another owner's is live."""

    async def release_lease(self, job_id: str, owner: str) -> None: ...

    async def close(self) -> None: ...
