"""What the batch store keeps: a job, an uploaded or produced file, one item's result."""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass, field

# Job statuses: OpenAI's vocabulary; the Anthropic view maps them onto processing_status.
VALIDATING, IN_PROGRESS, FINALIZING = "validating", "in_progress", "finalizing"
CANCELLING = "cancelling"
COMPLETED, FAILED, EXPIRED, CANCELLED = "completed", "failed", "expired", "cancelled"
ACTIVE_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)

# Item result types: Anthropic's vocabulary (OpenAI's output file has the succeeded ones, its error file the rest).
SUCCEEDED, ERRORED, CANCELED, EXPIRED_ITEM = "succeeded", "errored", "canceled", "expired"
RESULT_TYPES = (SUCCEEDED, ERRORED, CANCELED, EXPIRED_ITEM)

OPENAI, ANTHROPIC = "openai", "anthropic"


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass
class JobOwner:
    """The principal that created the job, as its items run (a snapshot: later key changes do not apply)."""

    key_id: str
    tenant: str
    tier: str
    limits: dict  # tenancy Limits fields
    cache_salt: str = ""
    safety_policy: str = ""  # its items are screened as the owner's own requests are


@dataclass
class BatchJob:
    id: str
    dialect: str  # OPENAI | ANTHROPIC
    owner: JobOwner
    endpoint: str  # the path each item is sent to
    created_at: float
    expires_at: float
    status: str = VALIDATING
    num_items: int = 0
    input_file_id: str = ""
    completion_window: str = "24h"
    metadata: dict | None = None
    times: dict[str, float] = field(default_factory=dict)  # status -> unix seconds it was entered
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] | None = None  # validation errors (OpenAI: the job failed)

    @property
    def tenant(self) -> str:
        return self.owner.tenant

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    def enter(self, status: str, now: float) -> None:
        self.status = status
        self.times.setdefault(status, now)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> BatchJob:
        raw = json.loads(text)
        raw["owner"] = JobOwner(**raw["owner"])
        return cls(**raw)


@dataclass
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredFile:
        return cls(**json.loads(text))


@dataclass
class ItemResult:
    """One item's outcome: the HTTP answer it got (succeeded/errored), or why it never ran (canceled/expired)."""

    type: str  # RESULT_TYPES
    status_code: int = 0
    body: dict | None = None
    request_id: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ItemResult:
        return cls(**json.loads(text))
