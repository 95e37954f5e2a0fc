"""The fixed-batch dispatcher under open-loop load: POST /v1/batch-generate against the real gateway, router and
simulated fixed-batch workers (processes on loopback; L = 200 ms, B = 50 by default), at a sweep of arrival rates.

Arrivals are open-loop (Poisson at the rate, fixed seed): each call is sent at its scheduled time whatever the
earlier ones are doing, and its latency runs from that scheduled time (no coordinated omission; a client that falls
behind shows up as latency, and as `send_lag_p95_ms`). The client is a small HTTP/1.1 keep-alive client on raw
asyncio streams (cheaper per call than httpx, since it shares the machine's cores with what it measures).

Per rate, medians over rounds: achieved rps (200s per second between the first and the last answer), p50/p95/p99 ms, errors, mean batch fill (calls per
batch / B, over the distinct batch ids answered), accelerators busy (batches x L / window) against the capacity
floor rps / (B / L) and against what that fill needs (rps / (fill x B / L)), and CPU ms per call in the gateway,
the router and the client. Also the highest rate whose median p95 stayed within --budget-ms. Last ONE JSON line.

  .venv/bin/python loadtest/bench_fixed_batch.py                       # rates 20 100 250 500 750 1000
  .venv/bin/python loadtest/bench_fixed_batch.py --rates 500 --rounds 5 --duration-s 5 --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flotilla.api.router.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from flotilla.fleet.certs import FleetCerts  # noqa: E402
from flotilla.fleet.process import ServiceProcess  # noqa: E402
from flotilla.rpc.options import sync_channel  # noqa: E402
from flotilla.tenancy.keys import KeyEntry, generate_key, hash_key, write_keys_file  # noqa: E402
from loadtest.common.cpu_time import process_cpu_s, own_cpu_s  # noqa: E402
from loadtest.simulate_fixed_batch import poisson_arrivals  # noqa: E402

MODEL = "sim"
START_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[20, 100, 250, 500, 750, 1000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration-s", type=float, default=4.0, help="arrivals per round")
    p.add_argument("--warmup-s", type=float, default=1.0, help="arrivals at each rate before the rounds, not counted")
    p.add_argument("--workers", type=int, default=4, help="simulated accelerators")
    p.add_argument("--batch-size", type=int, default=50, help="B")
    p.add_argument("--latency-ms", type=float, default=200.0, help="L")
    p.add_argument("--max-wait-ms", type=float, default=None, help="T (default: the router's, budget - 2 L)")
    p.add_argument("--budget-ms", type=float, default=500.0, help="p95 budget")
    p.add_argument("--paid-share", type=float, default=0.5)
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---- a minimal keep-alive HTTP/1.1 client --------------------------------------------------------------------
class Pool:
    def __init__(self, host: str, port: int, max_connections: int):
        self._host, self._port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def post(self, path: str, body: bytes, headers: bytes) -> tuple[int, bytes]:
        """(status, body); a kept-alive connection the server closed meanwhile is replaced once; a call that fails
        on a fresh connection is status 0."""
        request = (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                   + headers + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        async with self._slots:
            for reused in (bool(self._idle), False):
                conn = self._idle.pop() if reused else await asyncio.open_connection(self._host, self._port)
                try:
                    answer = await self._exchange(conn, request)
                except (asyncio.IncompleteReadError, ConnectionError):
                    conn[1].close()
                    if reused:
                        continue
                    return 0, b""
                self._idle.append(conn)
                return answer
            return 0, b""

    @staticmethod
    async def _exchange(conn, request: bytes) -> tuple[int, bytes]:
        reader, writer = conn
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return int(head[9:12]), await reader.readexactly(length)

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()


# ---- the fleet ------------------------------------------------------------------------------------------------
def service(state: Path, name: str, args: list[str]) -> ServiceProcess:
    """`flotilla ARGS` with its own certificate (mTLS, a throwaway CA in `state`)."""
    args = [*args, *FleetCerts(state).args(args[0], name)]
    process = ServiceProcess(name, args, state / "logs" / f"{name}.log", state / "ports" / f"{name}.port")
    process.start()
    return process


def start_fleet(args: argparse.Namespace, state: Path) -> tuple[list[ServiceProcess], str, str]:
    key = generate_key(), generate_key()
    keys_file = state / "keys.json"
    write_keys_file(keys_file, [KeyEntry("paid", hash_key(key[0]), "acme", "paid"),
                                KeyEntry("free", hash_key(key[1]), "freeloader", "free")])
    router_args = ["router", "--port", "0", "--batch-latency-budget-ms", str(args.budget_ms), "--log-level", "WARNING"]
    if args.max_wait_ms is not None:
        router_args += ["--batch-max-wait-ms", str(args.max_wait_ms)]
    router = service(state, "router", router_args)
    router.wait_port(START_TIMEOUT_S)
    processes = [router]
    for i in range(args.workers):
        processes.append(service(state, f"worker-{i}", [
            "worker", "--backend", "fixed-batch", "--model-name", MODEL, "--worker-id", f"w{i}", "--router",
            router.address, "--max-batch-size", str(args.batch_size), "--batch-latency-ms", str(args.latency_ms),
            "--log-level", "WARNING"]))
    gateway = service(state, "gateway", ["gateway", "--router", router.address, "--port", "0",
                                         "--keys-file", str(keys_file)])
    processes.append(gateway)
    for process in processes:
        process.wait_port(START_TIMEOUT_S)
    deadline = time.monotonic() + START_TIMEOUT_S
    with sync_channel(router.address, FleetCerts(state).client("operator", "bench"), "router") as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        while sum(s.healthy for s in stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers) < args.workers:
            if time.monotonic() > deadline:
                raise SystemExit("the workers did not register")
            time.sleep(0.05)
    return processes, *key


# ---- one round ------------------------------------------------------------------------------------------------
async def run_round(pool: Pool, rate: float, duration_s: float, paid_share: float, keys: tuple[str, str],
                    rng: random.Random) -> dict:
    headers = [f"authorization: Bearer {k}\r\n".encode() for k in keys]
    arrivals = poisson_arrivals(rate, duration_s, rng)
    latencies, lags, batches, errors, done = [], [], {}, {}, []
    start = time.perf_counter() + 0.05

    async def one(index: int, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))  # the schedule of an open-loop client
        scheduled = start + at
        lags.append(time.perf_counter() - scheduled)
        text = f"call {index} at {at:.4f}"
        body = json.dumps({"model": MODEL, "input": text}).encode()
        status, payload = await pool.post("/v1/batch-generate", body, headers[0 if rng.random() < paid_share else 1])
        if status != 200:
            errors[status] = errors.get(status, 0) + 1
            return
        done.append(time.perf_counter())
        latencies.append(done[-1] - scheduled)
        answer = json.loads(payload)
        batch = answer["batch"]
        batches[batch["id"]] = batch["size"]

    tasks = [asyncio.create_task(one(i, at)) for i, at in enumerate(arrivals)]
    await asyncio.gather(*tasks)
    # Throughput between the first and the last answer: the arrival rate while the fleet keeps up, its drain
    # rate when it does not (the first L + T of a round, before any answer, is not counted against it).
    window = (max(done) - min(done)) if len(done) > 1 else duration_s
    return {"sent": len(arrivals), "ok": len(latencies), "window_s": window, "rate_ok": (len(done) - 1) / window, "latencies": latencies, "lags": lags,
            "batches": batches, "errors": errors}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sweep(args: argparse.Namespace, gateway_port: int, keys: tuple[str, str], pids: dict[str, int]) -> list[dict]:
    pool = Pool("127.0.0.1", gateway_port, args.max_connections)
    rng = random.Random(args.seed)
    rows = []
    latency_s = args.latency_ms / 1000
    try:
        for rate in args.rates:
            await run_round(pool, rate, args.warmup_s, args.paid_share, keys, rng)
            rounds = []
            for _ in range(args.rounds):
                cpu_before = {name: process_cpu_s(pid) for name, pid in pids.items()}
                client_before = own_cpu_s()
                r = await run_round(pool, rate, args.duration_s, args.paid_share, keys, rng)
                cpu = {name: process_cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
                cpu["client"] = own_cpu_s() - client_before
                calls = max(1, r["sent"])
                sizes = list(r["batches"].values())
                fill = statistics.mean(sizes) / args.batch_size if sizes else 0.0
                rps = r["rate_ok"]
                rounds.append({
                    "achieved_rps": rps, "p50_ms": pct(r["latencies"], 0.5) * 1e3,
                    "p95_ms": pct(r["latencies"], 0.95) * 1e3, "p99_ms": pct(r["latencies"], 0.99) * 1e3,
                    "errors": sum(r["errors"].values()), "error_statuses": r["errors"],
                    "mean_batch_fill": fill, "num_batches": len(sizes),
                    "accelerators_busy": len(sizes) * latency_s / r["window_s"],
                    "send_lag_p95_ms": pct(r["lags"], 0.95) * 1e3,
                    **{f"cpu_ms_per_call_{name}": cpu[name] / calls * 1e3 for name in cpu},
                })
            row = {"rate": rate}
            for field in rounds[0]:
                if field == "error_statuses":
                    row[field] = rounds[-1][field]
                    continue
                row[field] = round(statistics.median(x[field] for x in rounds), 3)
            capacity = args.batch_size / latency_s  # calls per second per accelerator at full batches
            row["floor_accelerators"] = round(row["achieved_rps"] / capacity, 3)
            row["accelerators_at_measured_fill"] = (round(row["achieved_rps"] / (row["mean_batch_fill"] * capacity), 3)
                                                    if row["mean_batch_fill"] else None)
            rows.append(row)
            print(f"rate {rate:7.1f}/s  achieved {row['achieved_rps']:7.1f}/s  p50 {row['p50_ms']:6.1f}  "
                  f"p95 {row['p95_ms']:6.1f}  p99 {row['p99_ms']:6.1f} ms  errors {row['errors']:.0f}  "
                  f"fill {row['mean_batch_fill']:.2f}  busy {row['accelerators_busy']:.2f} "
                  f"(floor {row['floor_accelerators']:.2f})  cpu ms/call gw {row['cpu_ms_per_call_gateway']:.2f} "
                  f"router {row['cpu_ms_per_call_router']:.2f} client {row['cpu_ms_per_call_client']:.2f}  "
                  f"send lag p95 {row['send_lag_p95_ms']:.1f} ms", flush=True)
    finally:
        pool.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-fixed-batch-") as tmp:
        processes, paid_key, free_key = start_fleet(args, Path(tmp))
        try:
            pids = {"gateway": processes[-1].pid, "router": processes[0].pid}
            rows = asyncio.run(sweep(args, processes[-1].port, (paid_key, free_key), pids))
        finally:
            for process in reversed(processes):
                process.stop()
    within = [row["rate"] for row in rows if row["p95_ms"] <= args.budget_ms and row["errors"] == 0]
    summary = {"bench": "fixed_batch", "batch_size": args.batch_size, "latency_ms": args.latency_ms,
               "workers": args.workers, "budget_ms": args.budget_ms, "max_wait_ms": args.max_wait_ms,
               "rounds": args.rounds, "duration_s": args.duration_s,
               "highest_rate_within_budget": max(within) if within else None, "rows": rows}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
