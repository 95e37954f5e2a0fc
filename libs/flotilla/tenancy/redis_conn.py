"""Redis clients for the gateway: redis.asyncio over a BlockingConnectionPool.

The default pool raises once `max_connections` are in use; a blocking pool makes a burst wait for a
connection instead. Short socket timeouts: a Redis that is gone must turn into a fail-open/closed
decision quickly, not a stalled request.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from flotilla.tenancy.errors import BackendUnavailable

T = TypeVar("T")
DEFAULT_MAX_CONNECTIONS = 64
KEY_PREFIX = "flotilla:"


def connect(url: str, max_connections: int = DEFAULT_MAX_CONNECTIONS, timeout_s: float = 2.0,
            pool_wait_s: float = 10.0) -> aioredis.Redis:
    # pool_wait_s: a burst waits this long for a free connection; that is queueing, not Redis being down
    # (the pool raises the same ConnectionError when it runs out, so a short wait would read as an outage).
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_wait_s, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, decode_responses=True)
    return aioredis.Redis(connection_pool=pool)


async def call(awaitable: Awaitable[T]) -> T:
    """Await a Redis call; unreachable Redis becomes BackendUnavailable."""
    try:
        return await awaitable
    except (RedisConnectionError, RedisTimeoutError, OSError) as err:
        raise BackendUnavailable(f"redis unavailable: {err}") from err
