"""Sum usage records per tenant (and model), counting each request id once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from flotilla.usage.record import STATUS_INTERRUPTED, STATUS_OK, STATUS_OPEN, UsageRecord


@dataclass
class TenantUsage:
    tenant: str
    num_requests: int = 0
    num_ok: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0

    def add(self, record: UsageRecord) -> None:
        self.num_requests += 1
        self.num_ok += record.status == STATUS_OK
        self.input_tokens += record.input_tokens
        self.cached_input_tokens += record.cached_input_tokens
        self.output_tokens += record.output_tokens


def unique(records: Iterable[UsageRecord]) -> list[UsageRecord]:
    """One record per request id: its first final record (a sink write retried after a lost reply must not bill
    twice), else, for a request whose gateway died mid-stream, its checkpoint with the most delivered tokens, as
    status `interrupted`; one that had delivered nothing (its admission record only) bills nothing."""
    final: dict[str, UsageRecord] = {}
    checkpoints: dict[str, UsageRecord] = {}
    for record in records:
        if record.status != STATUS_OPEN:
            final.setdefault(record.request_id, record)
        elif record.output_tokens >= getattr(checkpoints.get(record.request_id), "output_tokens", -1):
            checkpoints[record.request_id] = record
    interrupted = [replace(r, status=STATUS_INTERRUPTED) for i, r in checkpoints.items()
                   if i not in final and r.output_tokens > 0]
    return [*final.values(), *interrupted]


def per_tenant(records: Iterable[UsageRecord], tenant: str | None = None) -> list[TenantUsage]:
    totals: dict[str, TenantUsage] = {}
    for record in unique(records):
        if tenant is None or record.tenant == tenant:
            totals.setdefault(record.tenant, TenantUsage(record.tenant)).add(record)
    return sorted(totals.values(), key=lambda t: t.tenant)
