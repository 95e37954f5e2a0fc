"""Base for request bodies: strict types (no "5" for 5, no true for 1) and no unknown fields. Top-level fields are
checked against field_support.py's tables before validation (an unsupported one is refused naming why); a field
unknown inside an object is refused by validation (body.py says it is not supported)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Bounds a request is refused past (400), whatever its byte size: they keep the work before tokenizing linear and
# small. The total text of a body is bounded in body.py (MAX_TEXT_CHARS).
MAX_MESSAGES = 10_000
MAX_CONTENT_BLOCKS = 1_000  # per message (and per system prompt, per tool result)
MAX_TOOLS = 256
MAX_PROMPT_TOKEN_IDS = 1 << 20  # /v1/completions with a prompt of token ids


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
