"""The engine offline, laid out like the fleet's workers: N processes with the same threads each, every one
running LLMEngine.generate on its share of the prompts (round robin) with its share of the batch bound.

A fleet of two single-threaded workers is compared with two single-threaded engines, not with one engine
using both cores: on a 2-core CPU host two 1-thread engines made 13-22% more tokens per second than one
2-thread engine (less OpenMP synchronisation per step), and a weaker baseline would flatter the fleet.

The engines are built once and stay up across rounds; each round starts them together and counts every
token over the span from the first start to the last finish (CLOCK_MONOTONIC is system-wide on Linux).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from loadtest.common.engine_workload import Workload

_ROOT = Path(__file__).resolve().parent.parent.parent


class OfflineEngines:
    def __init__(self, model_dir: Path, workload: Workload, num_processes: int, threads: int, concurrency: int):
        """`threads`: OMP_NUM_THREADS per process (0: torch's default)."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self._children = []
        for part in range(num_processes):
            child = subprocess.Popen([sys.executable, "-m", "loadtest.common.offline_engines"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            mine = workload.subset(list(range(part, workload.num_requests, num_processes)))
            share = {"model_dir": str(model_dir), "prompts": mine.prompts, "max_tokens": mine.max_tokens,
                     "max_num_seqs": max(1, concurrency // num_processes)}
            child.stdin.write(json.dumps(share) + "\n")
            child.stdin.flush()
            self._children.append(child)
        for child in self._children:
            if child.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError("an offline engine process failed to start")

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children]

    def round(self) -> tuple[float, int]:
        """One generate() of every share, started together: (output tok/s over the span, output tokens)."""
        for child in self._children:
            child.stdin.write("go\n")
            child.stdin.flush()
        runs = [json.loads(child.stdout.readline()) for child in self._children]
        num_tokens = sum(run["tokens"] for run in runs)
        return num_tokens / (max(run["end"] for run in runs) - min(run["start"] for run in runs)), num_tokens

    def close(self) -> None:
        for child in self._children:
            if child.poll() is None:
                child.stdin.close()
                child.wait(30)

    def __enter__(self) -> OfflineEngines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve() -> None:
    """Child: build the engine on its share, then one generate() per 'go' line until stdin closes."""
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.engine import LLMEngine
    from flotilla.engine.sampling_params import SamplingParams

    share = json.loads(sys.stdin.readline())
    engine = LLMEngine(EngineConfig(model_dir=share["model_dir"], max_num_seqs=share["max_num_seqs"],
                                    num_kv_blocks=8192))
    # Greedy, as the streaming client asks (sampling at temperature > 0 costs more per token).
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in share["max_tokens"]]
    engine.generate(share["prompts"][:2], params[:2])  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        start = time.monotonic()
        results = engine.generate(share["prompts"], params)
        end = time.monotonic()
        print(json.dumps({"tokens": sum(len(r.token_ids) for r in results), "start": start, "end": end}), flush=True)


if __name__ == "__main__":
    _serve()
