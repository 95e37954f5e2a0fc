"""Sum usage records per tenant (and model), counting each request id once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flotilla.usage.record import STATUS_OK, UsageRecord


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
    """First record per request id: a sink write retried after a lost reply must not bill twice."""
    seen: dict[str, UsageRecord] = {}
    for record in records:
        seen.setdefault(record.request_id, record)
    return list(seen.values())


def per_tenant(records: Iterable[UsageRecord], tenant: str | None = None) -> list[TenantUsage]:
    totals: dict[str, TenantUsage] = {}
    for record in unique(records):
        if tenant is None or record.tenant == tenant:
            totals.setdefault(record.tenant, TenantUsage(record.tenant)).add(record)
    return sorted(totals.values(), key=lambda t: t.tenant)
