"""Base for request bodies: strict types (no "5" for 5, no true for 1), unknown fields ignored as the real
APIs do, so that newer clients sending newer fields still work."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
