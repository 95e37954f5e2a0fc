"""The serving path's cost: the same streamed chat workload through the whole fleet (gateway -> router ->
worker, real processes on loopback) and through the engine offline (LLMEngine.generate on the same prompt
tokens, in as many processes with as many threads as the fleet's workers), in one run; optionally vLLM's
OpenAI server on the same checkpoint too. Exact output lengths (ignore_eos) so every system produces the
same tokens. Prints output tok/s of each, the fleet's loss against the offline engine, TTFT/TPOT of the
streamed runs, and last ONE JSON line.

  .venv/bin/python loadtest/bench_fleet.py --num-prompts 256 --max-concurrency 64
  .venv/bin/python loadtest/bench_fleet.py --size micro --max-concurrency 128 --stream-interval-ms 150
  .venv/bin/python loadtest/bench_fleet.py --workers 2 --worker-threads 1   # one single-threaded worker per core
  .venv/bin/python loadtest/bench_fleet.py --compare-vllm ~/vllm-cpu/.venv/bin/python
  .venv/bin/python loadtest/bench_fleet.py --worker-threads 1 --engine-cores 1   # the path on a core of its own
  .venv/bin/python loadtest/bench_fleet.py --workers 2 --worker-threads 1 --stream-path relay   # the old path
  .venv/bin/python loadtest/bench_fleet.py --worker-threads 1 --engine-cores 1 --engine-process   # no shared GIL

The JSON line has `router_cpu_us_per_token` (router CPU over the median round / its output tokens: ≈ 0 on the
lease path, where the router only places) and `fleet_over_offline` (median fleet tok/s / median offline tok/s).
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `flotilla` command sets for the worker

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from loadtest.common.checkpoint_cache import ensure_checkpoint  # noqa: E402
from loadtest.common.cpu_pinning import pin_process, spawned_engine_pids, split_cores  # noqa: E402
from loadtest.common.cpu_time import cpu_accounting  # noqa: E402
from loadtest.common.engine_workload import Workload  # noqa: E402
from loadtest.common.offline_engines import OfflineEngines  # noqa: E402
from loadtest.common.vllm_baseline import run_vllm, vllm_env  # noqa: E402
from loadtest.serving.client import Endpoint, run_workload  # noqa: E402
from loadtest.serving.stats import SLO, summarize  # noqa: E402
from loadtest.serving.workload import WorkloadConfig, build_workload  # noqa: E402

MODEL = "flotilla-tiny"
VLLM_THREADS = os.cpu_count() or 1  # bound to every core, like the fleet's worker (torch default)
VLLM_KV_CACHE_GIB = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("micro", "tiny", "small"), default="tiny",
                   help="micro: a model that costs next to nothing, so the serving path is what is measured")
    p.add_argument("--rounds", type=int, default=3, help="fleet and offline runs, alternated; medians reported")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64, help="streams in flight (saturates one worker)")
    p.add_argument("--input-words", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--compare-vllm", metavar="PYTHON", help="also vLLM's OpenAI server, run by this interpreter")
    p.add_argument("--stream-interval-ms", type=float, default=0.0, help="the workers' --stream-interval-ms")
    p.add_argument("--vllm-stream-interval", type=int, default=1,
                   help="vLLM's --stream-interval (tokens), e.g. what --stream-interval-ms comes to at the step time")
    p.add_argument("--workers", type=int, default=1, help="workers in the fleet (colocated, role both)")
    p.add_argument("--worker-threads", type=int, default=0,
                   help="OpenMP/torch threads per worker (0: torch's default, one per core); e.g. --workers 2 "
                        "--worker-threads 1 runs one single-threaded worker per core")
    p.add_argument("--engine-cores", type=int, default=0,
                   help="pin the workers and the offline engines to this many cores and the gateway, router and "
                        "benchmark client to the others, as in a deployment where the path has CPUs of its own "
                        "(0: no pinning, everything shares every core)")
    p.add_argument("--stream-path", choices=("auto", "direct", "relay"), default="auto",
                   help="the gateway's --stream-path: auto streams from the workers under leases (flotilla up's "
                        "fleet has a lease secret); relay sends every token through the router")
    p.add_argument("--engine-process", action="store_true",
                   help="the workers' --engine-process (the engine in a child process); with --engine-cores the "
                        "engine processes are pinned to the engine cores and the workers' gRPC to the others")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.engine_cores and args.compare_vllm:
        p.error("--engine-cores does not pin vLLM's server: run --compare-vllm without it")
    return args


def streamed(base_url: str, model: str, api_key: str, specs, concurrency: int) -> dict:
    endpoint = Endpoint(model, base_url, model, api_key, ignore_eos=True)
    run = asyncio.run(run_workload(endpoint, specs, concurrency, progress=False))
    return summarize(run, SLO(1.0, 0.1))


def chat_prompts(model_dir: Path, specs) -> list[list[int]]:
    """The prompt tokens the gateway builds for each request (same chat template)."""
    from flotilla.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    return [tokenizer.encode_chat(list(spec.messages)) for spec in specs]


def vllm_server(python: str, model_dir: Path, port: int, log: Path, stream_interval: int) -> subprocess.Popen:
    env = vllm_env(VLLM_THREADS, VLLM_KV_CACHE_GIB)
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
               "--stream-interval", str(stream_interval)]
    return subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def wait_http(url: str, timeout_s: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not up within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    from flotilla.fleet.local import FleetConfig, LocalFleet
    from flotilla.rpc.options import free_port

    args = parse_args(argv)
    model_dir = ensure_checkpoint(Path.home() / ".cache" / "flotilla" / "bench", args.size)
    specs = build_workload(WorkloadConfig(num_requests=args.num_prompts, input_words=tuple(args.input_words),
                                          output_tokens=tuple(args.output_tokens), seed=args.seed))
    line: dict = {"size": args.size, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                  "workers": args.workers, "worker_threads": args.worker_threads,
                  "stream_interval_ms": args.stream_interval_ms, "vllm_stream_interval": args.vllm_stream_interval,
                  "stream_path": args.stream_path, "engine_process": args.engine_process,
                  "loadavg_1m_start": os.getloadavg()[0]}
    workload = Workload(chat_prompts(model_dir, specs), [spec.max_tokens for spec in specs])
    # The offline engine laid out like the fleet's workers (processes, threads), each with its share.
    offline = OfflineEngines(model_dir, workload, args.workers, args.worker_threads, args.max_concurrency)
    engine_cores, path_cores = split_cores(args.engine_cores) if args.engine_cores else ([], [])
    line["engine_cores"], line["path_cores"] = engine_cores, path_cores
    if engine_cores:
        for pid in offline.pids:
            pin_process(pid, engine_cores)
    with offline, tempfile.TemporaryDirectory(prefix="bench-fleet-") as state:
        config = FleetConfig(model_dir=model_dir, state_dir=Path(state), model_name=MODEL, num_workers=args.workers,
                             env={"OMP_NUM_THREADS": str(args.worker_threads)} if args.worker_threads else {},
                             worker_args=["--num-kv-blocks", "8192", "--max-num-seqs", str(args.max_concurrency),
                                          "--stream-interval-ms", str(args.stream_interval_ms)]
                                         + (["--engine-process"] if args.engine_process else []),
                             router_args=["--max-requests-per-worker", str(args.max_concurrency)],  # one batch
                             # One anonymous key opens every stream: its per-key cap must not be what is measured.
                             gateway_args=["--stream-path", args.stream_path,
                                           "--max-streams-per-key", str(max(64, args.max_concurrency))])
        fleet_runs, offline_runs = [], []
        with LocalFleet(config) as fleet:
            streamed(fleet.gateway_url + "/v1", MODEL, "none", specs[:4], 4)  # warm-up
            pids = {service.name: service.pid for service in fleet.services()}
            for name, pid in list(pids.items()):
                for index, engine_pid in enumerate(spawned_engine_pids(pid) if name.startswith("worker") else []):
                    pids[f"{name}-engine{index or ''}"] = engine_pid  # its CPU counted apart from the worker's
            if engine_cores:
                for name, pid in pids.items():
                    on_engine = name.startswith("worker") and (not args.engine_process or name.endswith("engine"))
                    pin_process(pid, engine_cores if on_engine else path_cores)
                pin_process(os.getpid(), path_cores)  # the benchmark client
            # Rounds alternate fleet and offline so that a slow spell of a shared machine hits both alike.
            for round_index in range(args.rounds):
                with cpu_accounting(pids, {}) as cpu_s:
                    summary = streamed(fleet.gateway_url + "/v1", MODEL, "none", specs, args.max_concurrency)
                fleet_runs.append((summary, cpu_s))
                offline_runs.append(offline.round()[0])
                print(f"round {round_index + 1}: fleet {summary['output_tok_s']:.1f} output tok/s, "
                      f"offline engine {offline_runs[-1]:.1f}")
        fleet_summary, cpu_s = sorted(fleet_runs, key=lambda run: run[0]["output_tok_s"])[len(fleet_runs) // 2]
        report("fleet", fleet_summary, line)  # the median round
        line["fleet_tok_s_rounds"] = [round(run[0]["output_tok_s"], 1) for run in fleet_runs]
        line["offline_tok_s_rounds"] = [round(tok_s, 1) for tok_s in offline_runs]
        line["offline_tok_s"] = round(statistics.median(offline_runs), 1)
        num_tokens = fleet_summary["output_tok_s"] * cpu_s["wall"]
        line["fleet_cpu_us_per_token"] = {name: round(seconds / num_tokens * 1e6) for name, seconds in cpu_s.items()
                                          if name != "wall"}
        line["router_cpu_us_per_token"] = line["fleet_cpu_us_per_token"].get("router")
        print("fleet CPU µs per output token by process (median round): "
              + ", ".join(f"{k} {v}" for k, v in line["fleet_cpu_us_per_token"].items()))
        print(f"offline engine: {line['offline_tok_s']:.1f} output tok/s (median of {args.rounds})")
        line["fleet_loss_vs_offline"] = round(1 - line["fleet_tok_s"] / line["offline_tok_s"], 3)
        line["fleet_over_offline"] = round(line["fleet_tok_s"] / line["offline_tok_s"], 3)
        # Each round's fleet and offline runs are back to back: their ratio cancels most of a slow spell.
        paired = [run[0]["output_tok_s"] / tok_s for run, tok_s in zip(fleet_runs, offline_runs)]
        line["fleet_loss_vs_offline_paired"] = round(1 - statistics.median(paired), 3)
        print(f"fleet loses {line['fleet_loss_vs_offline']:.1%} output tok/s against the offline engine (medians); "
              f"{line['fleet_loss_vs_offline_paired']:.1%} by the median of the rounds' own ratios")
        if args.compare_vllm:
            port = free_port()
            server = vllm_server(args.compare_vllm, model_dir, port, Path(state) / "vllm.log",
                                 args.vllm_stream_interval)
            try:
                wait_http(f"http://127.0.0.1:{port}/v1/models", 600, server)
                base = f"http://127.0.0.1:{port}/v1"
                streamed(base, MODEL, "none", specs[:4], 4)
                report("vllm", streamed(base, MODEL, "none", specs, args.max_concurrency), line)
                line["fleet_over_vllm"] = round(line["fleet_tok_s"] / line["vllm_tok_s"], 3)
            finally:
                server.terminate()
                server.wait(30)
            # vLLM's own loss, server against offline, on the same prompts and batch bound
            outcome = run_vllm(args.compare_vllm, str(model_dir), workload,
                               VLLM_THREADS, VLLM_KV_CACHE_GIB, 900, max_num_seqs=args.max_concurrency)
            if outcome.throughput is None:
                print(f"vLLM offline skipped: {outcome.skipped_reason}")
            else:
                line["vllm_offline_tok_s"] = round(outcome.throughput.tok_s, 1)
                line["vllm_loss_vs_offline"] = round(1 - line["vllm_tok_s"] / line["vllm_offline_tok_s"], 3)
                print(f"vLLM offline: {line['vllm_offline_tok_s']:.1f} output tok/s; vLLM's server loses "
                      f"{line['vllm_loss_vs_offline']:.1%} against it")
    line["loadavg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(line))
    return 0


def report(name: str, summary: dict, line: dict) -> None:
    latency = summary["latency"]
    ms = {f"{name}_{metric[:-2]}_{stat}_ms": None if value is None else round(value * 1000, 1)
          for metric, row in latency.items() for stat, value in row.items() if stat in ("p50", "p95")}
    line[f"{name}_tok_s"] = round(summary["output_tok_s"], 1)
    line[f"{name}_tokens_per_event"] = round(summary["tokens_per_event"], 2)
    line[f"{name}_errors"] = summary["errors"]
    line.update(ms)
    print(f"{name}: {summary['num_ok']}/{summary['num_requests']} ok, {summary['output_tok_s']:.1f} output tok/s, "
          f"{summary['tokens_per_event']:.2f} tokens per SSE event, "
          + ", ".join(f"{k.split('_', 1)[1]} {v}" for k, v in ms.items()))


if __name__ == "__main__":
    sys.exit(main())
