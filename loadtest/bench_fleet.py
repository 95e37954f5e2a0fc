"""The serving path's cost: the same streamed chat workload through the whole fleet (gateway -> router ->
worker, real processes on loopback) and through the engine offline (LLMEngine.generate on the same prompt
tokens), in one run; optionally vLLM's OpenAI server on the same checkpoint too. Exact output lengths
(ignore_eos) so every system produces the same tokens. Prints output tok/s of each, the fleet's loss against
the offline engine, TTFT/TPOT of the streamed runs, and last ONE JSON line.

  .venv/bin/python loadtest/bench_fleet.py --num-prompts 256 --max-concurrency 64
  .venv/bin/python loadtest/bench_fleet.py --compare-vllm ~/vllm-cpu/.venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from loadtest.common.checkpoint_cache import ensure_checkpoint  # noqa: E402
from loadtest.serving.client import Endpoint, run_workload  # noqa: E402
from loadtest.serving.stats import SLO, summarize  # noqa: E402
from loadtest.serving.workload import WorkloadConfig, build_workload  # noqa: E402

MODEL = "flotilla-tiny"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64, help="streams in flight (saturates one worker)")
    p.add_argument("--input-words", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--compare-vllm", metavar="PYTHON", help="also vLLM's OpenAI server, run by this interpreter")
    p.add_argument("--stream-interval-ms", type=float, default=0.0, help="the worker's --stream-interval-ms")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def streamed(base_url: str, model: str, api_key: str, specs, concurrency: int) -> dict:
    endpoint = Endpoint(model, base_url, model, api_key, ignore_eos=True)
    run = asyncio.run(run_workload(endpoint, specs, concurrency, progress=False))
    return summarize(run, SLO(1.0, 0.1))


def offline(model_dir: Path, specs, concurrency: int) -> tuple[float, int]:
    """Output tok/s of LLMEngine.generate on the prompts the gateway would build (same chat template)."""
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.engine import LLMEngine
    from flotilla.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), max_num_seqs=concurrency, num_kv_blocks=8192))
    prompts = [engine.tokenizer.encode_chat(list(spec.messages)) for spec in specs]
    params = [SamplingParams(max_tokens=spec.max_tokens, temperature=1.0, ignore_eos=True) for spec in specs]
    engine.generate(prompts[:2], params[:2])  # warm-up
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    num_tokens = sum(len(r.token_ids) for r in results)
    return num_tokens / (time.perf_counter() - started), num_tokens


def vllm_server(python: str, model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
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
                  "stream_interval_ms": args.stream_interval_ms,
                  "loadavg_1m_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as state:
        config = FleetConfig(model_dir=model_dir, state_dir=Path(state), model_name=MODEL,
                             worker_args=["--num-kv-blocks", "8192", "--max-num-seqs", str(args.max_concurrency),
                                          "--stream-interval-ms", str(args.stream_interval_ms)])
        with LocalFleet(config) as fleet:
            streamed(fleet.gateway_url + "/v1", MODEL, "none", specs[:4], 4)  # warm-up
            fleet_summary = streamed(fleet.gateway_url + "/v1", MODEL, "none", specs, args.max_concurrency)
        report("fleet", fleet_summary, line)
        line["offline_tok_s"], _ = offline(model_dir, specs, args.max_concurrency)
        print(f"offline engine: {line['offline_tok_s']:.1f} output tok/s")
        line["fleet_loss_vs_offline"] = round(1 - line["fleet_tok_s"] / line["offline_tok_s"], 3)
        print(f"fleet loses {line['fleet_loss_vs_offline']:.1%} output tok/s against the offline engine")
        if args.compare_vllm:
            port = free_port()
            server = vllm_server(args.compare_vllm, model_dir, port, Path(state) / "vllm.log")
            try:
                wait_http(f"http://127.0.0.1:{port}/v1/models", 600, server)
                base = f"http://127.0.0.1:{port}/v1"
                streamed(base, MODEL, "none", specs[:4], 4)
                report("vllm", streamed(base, MODEL, "none", specs, args.max_concurrency), line)
                line["fleet_over_vllm"] = round(line["fleet_tok_s"] / line["vllm_tok_s"], 3)
            finally:
                server.terminate()
                server.wait(30)
    line["loadavg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(line))
    return 0


def report(name: str, summary: dict, line: dict) -> None:
    latency = summary["latency"]
    ms = {f"{name}_{metric[:-2]}_{stat}_ms": None if value is None else round(value * 1000, 1)
          for metric, row in latency.items() for stat, value in row.items() if stat in ("p50", "p95")}
    line[f"{name}_tok_s"] = round(summary["output_tok_s"], 1)
    line[f"{name}_errors"] = summary["errors"]
    line.update(ms)
    print(f"{name}: {summary['num_ok']}/{summary['num_requests']} ok, {summary['output_tok_s']:.1f} output tok/s, "
          + ", ".join(f"{k.split('_', 1)[1]} {v}" for k, v in ms.items()))


if __name__ == "__main__":
    sys.exit(main())
