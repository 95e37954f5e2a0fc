"""Sum usage records per tenant and traffic class (interactive, batch), counting each request once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from flotilla.usage.record import STATUS_INTERRUPTED, STATUS_OK, STATUS_OPEN, UsageRecord


@dataclass
class TenantUsage:
    tenant: str
    traffic_class: str = "interactive"  # or "batch": items of batch jobs
    num_requests: int = 0
    num_ok: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    billable_tokens: int = 0  # input + output at each record's price factor (the batch rate for batch items)

    def add(self, record: UsageRecord) -> None:
        self.num_requests += 1
        self.num_ok += record.status == STATUS_OK
        self.input_tokens += record.input_tokens
        self.cached_input_tokens += record.cached_input_tokens
        self.output_tokens += record.output_tokens
        self.billable_tokens += record.billable_tokens


def unique(records: Iterable[UsageRecord]) -> list[UsageRecord]:
    """One record per request: its first final record (a sink write retried after a lost reply must not bill
    twice). A batch item is one request however often it ran (retried after a refusal, re-run after a gateway
    restart): its first ok record, else its first. A request with no final record (its gateway died mid-stream)
    bills its checkpoint with the most delivered tokens, as status `interrupted`; one that had delivered nothing
    (its admission record only) bills nothing."""
    final: dict[tuple, UsageRecord] = {}
    checkpoints: dict[tuple, UsageRecord] = {}
    for record in records:
        key = ("item", record.batch_id, record.batch_item) if record.batch_id else ("request", record.request_id)
        if record.status == STATUS_OPEN:
            if record.output_tokens >= getattr(checkpoints.get(key), "output_tokens", -1):
                checkpoints[key] = record
            continue
        kept = final.setdefault(key, record)
        if kept.status != STATUS_OK and record.status == STATUS_OK:
            final[key] = record
    interrupted = [replace(r, status=STATUS_INTERRUPTED) for key, r in checkpoints.items()
                   if key not in final and r.output_tokens > 0]
    return [*final.values(), *interrupted]


def per_tenant(records: Iterable[UsageRecord], tenant: str | None = None) -> list[TenantUsage]:
    """One total per (tenant, traffic class), sorted by both."""
    totals: dict[tuple[str, str], TenantUsage] = {}
    for record in unique(records):
        if tenant is None or record.tenant == tenant:
            key = (record.tenant, record.traffic_class)
            totals.setdefault(key, TenantUsage(*key)).add(record)
    return [totals[key] for key in sorted(totals)]
