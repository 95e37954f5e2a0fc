"""Placement rate of one router: Acquire with 1,000 registered fake workers (router/lease_service.py).

Two measurements, one run:
- decision latency: the router's own Acquire handler (admission, the disaggregation planner, signing the lease)
  called in-process one request at a time, from the call to the Lease event; p50/p99, wall clock and the thread's
  CPU time (on a shared machine the wall clock's tail is mostly other processes' time slices);
- Acquire/s over gRPC: a router process (this file with --serve) holding the fake workers, and this process
  opening Acquire streams on one AcquireSession (as a gateway does) with --concurrency in flight, each released
  (closed with a StreamReport) as soon as its lease arrives; and the router process's CPU time per Acquire (its
  share of a core is what the rate depends on when other processes load the machine: 1 s / that is its rate on a
  core of its own).

The fake workers are registry entries with a load report and no process (nothing dials them: a lease is only a
decision). With --shared-prefix every worker's report lists the prompt's first two blocks in its prefix cache (a
system prompt all of them hold), so the planner's prefix affinity has 1,000 holders to choose from. Their heartbeats
do not expire during the run (a real fleet of 1,000 workers heartbeating every
250 ms would cost the router 4,000 Heartbeat calls a second on top; not measured here).

    .venv/bin/python loadtest/bench_placement.py [--workers 1000] [--models 1] [--rounds 3] [--shared-prefix]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.api.router.v1 import router_pb2 as rpb

PROMPT = list(range(100, 164))  # 64 tokens: four full blocks for the prefix-affinity hashes


class _NoChannel:
    """What a registry entry needs of a channel: stubs are built, never called."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    async def close(self) -> None:
        return None


def build_router(num_workers: int, num_models: int, shared_prefix: bool = False):
    from flotilla.engine.block_hash import hash_full_blocks
    from flotilla.router.admission import Admission
    from flotilla.router.placement import PlacementLimits
    from flotilla.router.registry import WorkerRegistry
    from flotilla.router.service import RouterService
    from flotilla.rpc.leases import LeaseSigner

    cached = hash_full_blocks(PROMPT[:32], 16, "") if shared_prefix else []
    registry = WorkerRegistry(heartbeat_timeout_s=1e9, evict_after_s=1e9, channel_factory=lambda address: _NoChannel())
    for i in range(num_workers):
        model = f"model-{i % num_models}"
        info = rpb.WorkerInfo(worker_id=f"fake-{i}", address=f"10.0.{i // 250}.{i % 250}:50000", role=pb.WORKER_ROLE_BOTH,
                              model=pb.ModelInfo(name=model, version="v1", max_model_len=4096))
        registry.register(info)
        registry.heartbeat(info.worker_id, pb.LoadReport(num_free_blocks=4096, num_total_blocks=4096, block_size=16,
                                                         num_running=i % 7, num_queued_tokens=(i % 13) * 50,
                                                         cached_block_hashes=cached))
    limits = PlacementLimits(max_requests_per_worker=10**6, max_queued_tokens_per_worker=10**9)
    admission = Admission(registry, {}, [f"model-{m}" for m in range(num_models)], limits, max_queue_depth=10**6,
                          max_queue_wait_s=30.0)
    return RouterService(registry, admission, heartbeat_interval_s=0.25, leases=LeaseSigner(os.urandom(32)))


def acquire_request(i: int, num_models: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"req-{i}", model=f"model-{i % num_models}", prompt_token_ids=PROMPT,
                              sampling=pb.SamplingParams(max_tokens=64), tenant_id=f"tenant-{i % 16}",
                              priority=pb.PRIORITY_CLASS_INTERACTIVE)


class _Context:
    """The handler's ServicerContext: the first write is the answer."""

    def __init__(self) -> None:
        self.answer: asyncio.Future[pb.GenerateResponse] = asyncio.get_running_loop().create_future()
        self.report = pb.StreamReport(finished=True, num_output_tokens=64, ttft_s=0.05, tpot_s=0.02)

    async def write(self, response: pb.GenerateResponse) -> None:
        if not self.answer.done():
            self.answer.set_result(response)

    def invocation_metadata(self):
        return ()


async def decision_latencies(num_workers: int, num_models: int, num_requests: int,
                             shared_prefix: bool = False) -> tuple[list[float], list[float]]:
    """(wall-clock latencies, CPU times) of one decision each."""
    service = build_router(num_workers, num_models, shared_prefix)
    latencies, cpu_times = [], []
    for i in range(num_requests):
        context = _Context()
        started, cpu_started = time.perf_counter(), time.thread_time()
        task = asyncio.ensure_future(service.Acquire(acquire_request(i, num_models), context))
        answer = await context.answer
        latencies.append(time.perf_counter() - started)
        cpu_times.append(time.thread_time() - cpu_started)
        assert answer.HasField("lease"), answer
        task.cancel()  # the release, as a gateway's close
        await asyncio.gather(task, return_exceptions=True)
    return latencies, cpu_times


async def serve(port_file: str, num_workers: int, num_models: int, shared_prefix: bool = False) -> None:
    from flotilla.api.router.v1 import router_pb2_grpc
    from flotilla.rpc.options import aio_server

    service = build_router(num_workers, num_models, shared_prefix)
    server = aio_server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    await server.wait_for_termination()


async def acquire_rate(address: str, num_models: int, concurrency: int, duration_s: float) -> tuple[float, list]:
    from flotilla.api.router.v1 import router_pb2_grpc
    from flotilla.rpc.options import aio_channel
    from flotilla.rpc.session_client import SessionClient

    channel = aio_channel(address)
    session = SessionClient(router_pb2_grpc.RouterServiceStub(channel).AcquireSession)
    report = pb.StreamReport(finished=True, num_output_tokens=64, ttft_s=0.05, tpot_s=0.02)
    counter = iter(range(10**9))
    round_trips: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def loop() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            stream = session.generate(acquire_request(next(counter), num_models))
            answer = await stream.__anext__()
            round_trips.append(time.perf_counter() - started)
            assert answer.HasField("lease"), answer
            stream.cancel(report)

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    session.close()
    await channel.close()
    return len(round_trips) / elapsed, round_trips


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=1000)[int(q * 1000) - 1] * 1000, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--models", type=int, default=1, help="the workers are spread over this many models")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decisions", type=int, default=2000, help="in-process decisions per round")
    p.add_argument("--concurrency", type=int, default=64, help="Acquire streams in flight over gRPC")
    p.add_argument("--duration-s", type=float, default=5.0, help="gRPC run length per round")
    p.add_argument("--shared-prefix", action="store_true", help="every worker caches the prompt's first two blocks")
    p.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve, args.workers, args.models, args.shared_prefix))
        return 0
    line: dict = {"workers": args.workers, "models": args.models, "concurrency": args.concurrency,
                  "shared_prefix": args.shared_prefix,
                  "loadavg_1m_start": os.getloadavg()[0]}
    p50s, p99s, cpu_p50s, cpu_p99s, rates, rtt99s, router_cpus = [], [], [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as state:
        port_file = os.path.join(state, "port")
        server = subprocess.Popen([sys.executable, __file__, "--serve", port_file, "--workers", str(args.workers),
                                   "--models", str(args.models), *(["--shared-prefix"] if args.shared_prefix else [])])
        try:
            while not os.path.exists(port_file) or not Path(port_file).read_text():
                if server.poll() is not None:
                    raise SystemExit("the router process exited")
                time.sleep(0.05)
            address = f"127.0.0.1:{Path(port_file).read_text()}"

            async def rounds() -> None:  # one event loop for all (grpc.aio's poller outlives a closed one noisily)
                for round_index in range(args.rounds):
                    latencies, cpu_times = await decision_latencies(args.workers, args.models, args.decisions,
                                                                    args.shared_prefix)
                    cpu_before = _process_cpu_s(server.pid)
                    rate, round_trips = await acquire_rate(address, args.models, args.concurrency, args.duration_s)
                    router_cpus.append(round((_process_cpu_s(server.pid) - cpu_before) / len(round_trips) * 1e6))
                    p50s.append(_ms(latencies, 0.50))
                    p99s.append(_ms(latencies, 0.99))
                    cpu_p50s.append(_ms(cpu_times, 0.50))
                    cpu_p99s.append(_ms(cpu_times, 0.99))
                    rates.append(round(rate))
                    rtt99s.append(_ms(round_trips, 0.99))
                    print(f"round {round_index + 1}: decision p50 {p50s[-1]} ms p99 {p99s[-1]} ms (CPU p50 "
                          f"{cpu_p50s[-1]} ms p99 {cpu_p99s[-1]} ms); {rates[-1]} Acquire/s over gRPC (round trip "
                          f"p99 {rtt99s[-1]} ms; router CPU {router_cpus[-1]} us per Acquire)")

            asyncio.run(rounds())
        finally:
            server.terminate()
            server.wait(10)
    line.update(decision_p50_ms=statistics.median(p50s), decision_p99_ms=statistics.median(p99s),
                decision_cpu_p50_ms=statistics.median(cpu_p50s), decision_cpu_p99_ms=statistics.median(cpu_p99s),
                acquire_per_s=statistics.median(rates), acquire_round_trip_p99_ms=statistics.median(rtt99s),
                router_cpu_us_per_acquire=statistics.median(router_cpus),
                decision_p99_ms_rounds=p99s, decision_cpu_p99_ms_rounds=cpu_p99s, acquire_per_s_rounds=rates, loadavg_1m_end=os.getloadavg()[0])
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
