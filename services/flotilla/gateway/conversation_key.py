"""The conversation a request belongs to, for the router's sticky rollout split (GenerateRequest.affinity_key):
the client's user id (OpenAI `user`, Anthropic `metadata.user_id`) when given, else a hash of the messages up
to and including the first user message (with the system prompt), which every later turn of a chat repeats.
Scoped by tenant: two tenants' users with the same id are different conversations. "" when there is neither
(a text completion without `user`): the router buckets the request id, so such requests are split at random."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel


def conversation_key(tenant: str, user: str | None, system: Any = None,
                     messages: Sequence[BaseModel] = ()) -> str:
    if user:
        return f"user:{tenant}:{user}"
    opening = _opening(messages)
    if not opening:
        return ""
    body = json.dumps({"system": _plain(system), "messages": [m.model_dump(mode="json", exclude_none=True)
                                                              for m in opening]}, sort_keys=True)
    return f"conv:{tenant}:{hashlib.blake2b(body.encode(), digest_size=16).hexdigest()}"


def _opening(messages: Sequence[BaseModel]) -> list[BaseModel]:
    for index, message in enumerate(messages):
        if getattr(message, "role", None) == "user":
            return list(messages[: index + 1])
    return list(messages[:1])


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value
