"""Admission cost per request: authenticate + reserve + settle through the tenancy gatekeeper, quotas on
vs off, Redis and in-process backends, side by side in one run. Redis is a real redis-server started on a
free 127.0.0.1 port; round trips are counted by Redis itself (INFO stats: commands processed).

    .venv/bin/python loadtest/bench_admission.py [--requests 2000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import redis

from flotilla.tenancy.file_keys import FileKeyStore, write_keys_file
from flotilla.tenancy.gatekeeper import Gatekeeper
from flotilla.tenancy.key_hashing import generate_key, hash_key
from flotilla.tenancy.local_quota import LocalQuotaStore
from flotilla.tenancy.records import Limits, TenantKey
from flotilla.tenancy.redis_conn import connect
from flotilla.tenancy.redis_keys import RedisKeyStore
from flotilla.tenancy.redis_quota import RedisQuotaStore

QUOTA = Limits(tokens_per_minute=10**12, requests_per_minute=10**9, max_concurrent=10**6)


def start_redis(data_dir: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", data_dir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return proc, port
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


async def one_request(gate: Gatekeeper, key: str) -> None:
    entry = await gate.authenticate(key)
    reservation = await gate.reserve(entry.tenant, entry.limits, uuid.uuid4().hex, 120)
    await gate.settle(reservation, 80)


async def measure(gate: Gatekeeper, key: str, num_requests: int, concurrency: int) -> tuple[float, float]:
    """(µs per request one at a time, requests/s with `concurrency` in flight); call warm() first."""
    start = time.perf_counter()
    for _ in range(num_requests):
        await one_request(gate, key)
    sequential_us = (time.perf_counter() - start) / num_requests * 1e6
    per_worker = num_requests // concurrency

    async def worker() -> None:
        for _ in range(per_worker):
            await one_request(gate, key)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sequential_us, per_worker * concurrency / (time.perf_counter() - start)


# Commands a client sends itself; what the Lua scripts run inside Redis is not a round trip.
TOP_LEVEL = ("hgetall", "evalsha", "eval", "script|load", "script")


async def warm(gate: Gatekeeper, key: str) -> None:
    for _ in range(50):
        await one_request(gate, key)  # connections, Redis's script cache


def commands_processed(port: int) -> int:
    stats = redis.Redis(port=port).info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in TOP_LEVEL)


def usec_per_call(port: int) -> dict[str, float]:
    stats = redis.Redis(port=port).info("commandstats")
    return {name: stats[f"cmdstat_{name}"]["usec_per_call"] for name in ("hgetall", "evalsha") if f"cmdstat_{name}" in stats}


async def redis_case(port: int, limits: Limits, args) -> tuple[float, float, float]:
    client = connect(f"redis://127.0.0.1:{port}/0")
    keys = RedisKeyStore(client)
    key = generate_key()
    await keys.create(TenantKey(f"bench-{uuid.uuid4().hex[:8]}", hash_key(key), f"t-{uuid.uuid4().hex[:8]}",
                                limits=limits))
    gate = Gatekeeper(keys, RedisQuotaStore(client), client)
    await warm(gate, key)
    before = commands_processed(port)
    sequential_us, rps = await measure(gate, key, args.requests, args.concurrency)
    num_calls = args.requests + (args.requests // args.concurrency) * args.concurrency
    round_trips = (commands_processed(port) - before) / num_calls
    print(f"  redis server time per call ({'on' if not limits.is_unlimited else 'off'}): {usec_per_call(port)}")
    await gate.close()
    return sequential_us, rps, round_trips


async def file_case(path: str, limits: Limits, args) -> tuple[float, float, float]:
    key = generate_key()
    write_keys_file(path, [TenantKey("bench", hash_key(key), "t", limits=limits)])
    gate = Gatekeeper(FileKeyStore(path), LocalQuotaStore())
    await warm(gate, key)
    sequential_us, rps = await measure(gate, key, args.requests, args.concurrency)
    return sequential_us, rps, 0.0


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_redis(tmp)
        try:
            rows = [("redis", "off", *await redis_case(port, Limits(), args)),
                    ("redis", "on", *await redis_case(port, QUOTA, args)),
                    ("file+local", "off", *await file_case(f"{tmp}/keys.json", Limits(), args)),
                    ("file+local", "on", *await file_case(f"{tmp}/keys.json", QUOTA, args))]
        finally:
            proc.terminate()
            proc.wait()
    print(f"admission cost per request (authenticate + reserve + settle), {args.requests} requests")
    print(f"{'backend':<11} {'quotas':<6} {'µs/request':>11} {'req/s @' + str(args.concurrency):>11} "
          f"{'redis round trips':>18}")
    for backend, quotas, us, rps, trips in rows:
        print(f"{backend:<11} {quotas:<6} {us:>11.1f} {rps:>11.0f} {trips:>18.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
