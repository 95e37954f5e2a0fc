"""Fair queueing and overload through the real fleet (router holds the backlog: 4 requests per worker).

Fairness: tenant A floods 500 requests; tenant B's requests are served within about one round of A's,
not behind A's backlog. Overload (~3x capacity): paid interactive requests all succeed while free and
batch ones are refused with 529 + Retry-After; every request gets an answer. Latency figures are printed
(the timing comparison itself is loadtest/bench_admission.py's job, not an assertion here).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.fleet import MODEL

from .conftest import MAX_REQUESTS_PER_WORKER

PROMPT = list(range(30, 44))  # 14 tokens


def p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.95 * len(values)))]


async def post(client, url, key, max_tokens=4, **extra):
    return await client.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                             json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                   **extra})


async def ttft(client, url, key) -> float:
    """Seconds to the first streamed token."""
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                             json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                   "stream": True}) as response:
        assert response.status_code == 200
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
        return first if first is not None else time.perf_counter() - start


def flood_answers(path: Path) -> list[tuple[float, int]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [(float(t), int(s)) for t, s in (line.split() for line in lines if line.count(" ") == 1)]


async def test_a_flood_does_not_delay_another_tenant_beyond_a_round(tenancy_fleet, tmp_path):
    a_key, b_key = tenancy_fleet.create_key("flooder"), tenancy_fleet.create_key("quiet")
    a_url, b_url = tenancy_fleet.urls[0], tenancy_fleet.urls[1]
    answers = tmp_path / "flood.txt"
    async with httpx.AsyncClient(timeout=120) as client:
        # Enough samples that p95 is a percentile, not the single worst probe (20 and 40 probes).
        unloaded = [await ttft(client, b_url, b_key) for _ in range(20)]
        flood = subprocess.Popen([sys.executable, str(Path(__file__).with_name("flood.py")), a_url, a_key, "500",
                                  str(answers)])
        try:
            while len(flood_answers(answers)) < 40:
                assert flood.poll() is None, "the flood ended early"
                await asyncio.sleep(0.02)  # polling: by now A's whole flood has reached the router's queue
            loaded, a_served_meanwhile, a_left = [], [], []
            for _ in range(40):
                sent = time.time()
                loaded.append(await ttft(client, b_url, b_key))
                done = flood_answers(answers)
                a_served_meanwhile.append(sum(1 for t, _ in done if t > sent))
                a_left.append(500 - len(done))
            assert flood.wait(120) == 0
        finally:
            flood.kill()
    statuses = [s for _, s in flood_answers(answers)]
    assert len(statuses) == 500
    print(f"\nB TTFT p95 unloaded {p95(unloaded) * 1000:.1f} ms, during A's flood {p95(loaded) * 1000:.1f} ms "
          f"(x{p95(loaded) / p95(unloaded):.2f}); A served while B waited: {a_served_meanwhile}; A left: {a_left}")
    assert set(statuses) <= {200, 529}  # A's own flood may outgrow A's wait budget: A is shed, not B
    assert min(a_left) >= 100  # B was measured while A's backlog was long: FIFO would put B behind it
    # Typically one DRR round of A (32-token quantum x paid weight 4 / 18-token requests, i.e. 7) plus what
    # was on the worker, and what finishes while B's placement waits for a heartbeat. FIFO would serve all
    # of A's backlog (>= 100, asserted above) first. The median, with room for a few rounds: on a busy
    # 2-core machine the processes stall now and then.
    one_round = 128 // 18 + 2 * MAX_REQUESTS_PER_WORKER
    assert sorted(a_served_meanwhile)[len(a_served_meanwhile) // 2] <= 3 * one_round


async def test_overload_sheds_batch_and_free_first_and_answers_everyone(tenancy_fleet):
    paid = tenancy_fleet.create_key("paid-co")
    free = tenancy_fleet.create_key("free-co", "--tier", "free")
    batch = tenancy_fleet.create_key("batch-co", "--priority-class", "batch")
    urls = tenancy_fleet.urls
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1000)) as client:
        start = time.perf_counter()
        warmup = await asyncio.gather(*(post(client, urls[i % 3], paid, max_tokens=32) for i in range(32)))
        capacity_rps = len(warmup) / (time.perf_counter() - start)
        assert all(r.status_code == 200 for r in warmup)
        # open loop at ~3x capacity for a few seconds: paid 0.6x, free 1.2x, batch 1.2x
        rate, duration_s = 3 * capacity_rps, 4.0
        mix = [paid, free, batch, free, batch]  # per 5 arrivals: 1 paid, 2 free, 2 batch
        tasks, kinds = [], []
        for i in range(int(rate * duration_s)):
            key = mix[i % 5]
            kinds.append({paid: "paid", free: "free", batch: "batch"}[key])
            tasks.append(asyncio.create_task(post(client, urls[i % 3], key, max_tokens=32)))
            await asyncio.sleep(1 / rate)  # arrival pacing of the open-loop load, not a wait for a condition
        responses = await asyncio.gather(*tasks)
    by_kind: dict[str, list[httpx.Response]] = {"paid": [], "free": [], "batch": []}
    for kind, response in zip(kinds, responses):
        by_kind[kind].append(response)
    summary = {k: sorted({r.status_code for r in v}) for k, v in by_kind.items()}
    counts = {k: sum(r.status_code == 200 for r in v) / len(v) for k, v in by_kind.items()}
    print(f"\ncapacity ~{capacity_rps:.0f} req/s, offered {rate:.0f} req/s for {duration_s} s: "
          f"statuses {summary}, success {counts}")
    assert counts["paid"] >= 0.99
    for kind in ("free", "batch"):
        shed = [r for r in by_kind[kind] if r.status_code == 529]
        assert shed, f"no {kind} request was shed"
        assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "server_error" for r in shed)
    for response in responses:  # nothing admitted is dropped: every answer is a whole result or a 529
        assert response.status_code in (200, 529)
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] >= 1
