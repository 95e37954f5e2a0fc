"""Base for request bodies: strict types (no "5" for 5, no true for 1) and no unknown fields. Top-level fields are
checked against field_support.py's tables before validation (an unsupported one is refused naming why); a field
unknown inside an object is refused by validation (body.py says it is not supported)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
