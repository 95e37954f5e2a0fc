"""Rate-limit headers in each API dialect's style, and Retry-After.

Anthropic: anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}, reset as an RFC 3339 time.
OpenAI: x-ratelimit-{limit,remaining,reset}-{requests,tokens}, reset as a duration such as "6m0s".
Only limits that are set (non-zero) are described.
"""

from __future__ import annotations

import datetime
import math

from flotilla.tenancy.quota import QuotaState


def retry_after_value(seconds: float) -> str:
    """Whole seconds, rounded up, at least 1: a client that waits that long may succeed."""
    return str(max(1, math.ceil(seconds)))


def anthropic_headers(state: QuotaState, now_unix_s: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, limit, remaining, reset_s in _rows(state):
        prefix = f"anthropic-ratelimit-{kind}"
        headers[f"{prefix}-limit"] = str(limit)
        headers[f"{prefix}-remaining"] = str(remaining)
        headers[f"{prefix}-reset"] = _rfc3339(now_unix_s + reset_s)
    return headers


def openai_headers(state: QuotaState) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, limit, remaining, reset_s in _rows(state):
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
        headers[f"x-ratelimit-reset-{kind}"] = _duration(reset_s)
    return headers


def _rows(state: QuotaState) -> list[tuple[str, int, int, float]]:
    rows = []
    if state.limits.requests_per_minute:
        rows.append(("requests", state.limits.requests_per_minute, state.requests_remaining, state.requests_reset_s))
    if state.limits.tokens_per_minute:
        rows.append(("tokens", state.limits.tokens_per_minute, state.tokens_remaining, state.tokens_reset_s))
    return rows


def _rfc3339(unix_s: float) -> str:
    moment = datetime.datetime.fromtimestamp(math.ceil(unix_s), tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float) -> str:
    """OpenAI's style: "250ms", "6s", "1m30s"."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
