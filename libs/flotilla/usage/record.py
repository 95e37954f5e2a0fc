"""One request's usage record and its wire forms (Redis stream fields, one JSON line)."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields

from flotilla.usage.pricing import charged_tokens

STATUS_OK = "ok"  # finished (stop or length)
STATUS_ERROR = "error"  # ended with an error (see error_code)
STATUS_CANCELLED = "cancelled"  # the caller went away before the end
STATUS_FILTERED = "filtered"  # the gateway's safety stage stopped the answer (output_tokens: those sent before)
# Written while a request runs (at admission, then every checkpoint interval of streaming) so a gateway that dies
# mid-stream still leaves what it had delivered; any record with another status for the same request id
# supersedes it (summary.unique).
STATUS_OPEN = "open"
# Read-side only: a request whose last record is a checkpoint (its gateway died before the end).
STATUS_INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    tenant: str
    key_id: str
    model: str  # as the router resolved it (name@version), else as requested
    model_version: str
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int  # delivered to the caller: what is billed
    status: str
    error_code: str  # "" unless status is error
    attempts: int  # workers the request was placed on (1 without a failure; 0 if never placed)
    started_at: float  # unix seconds
    finished_at: float
    batch_id: str = ""  # the batch job this request was an item of; "" for interactive traffic
    batch_item: int = -1  # its index in that job
    price_factor: float = 1.0  # what its tokens are charged, as a fraction: a batch item's batch rate

    @property
    def traffic_class(self) -> str:
        return "batch" if self.batch_id else "interactive"

    @property
    def billable_tokens(self) -> int:
        """Input (cached too) + output tokens at its price factor: what its tenant's token quota was charged."""
        return charged_tokens(self.input_tokens + self.output_tokens, self.price_factor)

    def to_fields(self) -> dict[str, str]:
        return {name: str(value) for name, value in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> UsageRecord:
        """From Redis stream fields or a JSON object; unknown fields are ignored, missing ones are an error
        (except those with a default: records written before they existed)."""
        values = {}
        for f in fields(cls):
            if f.name not in raw:
                if f.default is not MISSING:
                    continue
                raise ValueError(f"usage record without {f.name!r}: {raw!r}")
            values[f.name] = _typed(f.type, raw[f.name])
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def _typed(type_name: object, value: object) -> object:
    if type_name in ("int", int):
        return int(value)
    if type_name in ("float", float):
        return float(value)
    return str(value)
