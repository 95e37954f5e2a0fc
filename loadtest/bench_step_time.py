"""Engine step time against the number of decoding sequences (what the batch bound's target trades against):
`--batch-sizes` groups of greedy requests (14-token prompts, --max-tokens forced with ignore_eos), each group run
alone to completion in one LLMEngine; reports the median step time of its decode steps (after the prefill step).
Used to choose --target-tpot-ms's CPU default (libs/flotilla/engine/config.py).

  OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_step_time.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.common.checkpoint_cache import ensure_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.engine import LLMEngine
    from flotilla.engine.new_request import NewRequest
    from flotilla.engine.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("micro", "tiny", "small"), default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args(argv)
    model_dir = ensure_checkpoint(Path.home() / ".cache" / "flotilla" / "bench", args.size)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), device=args.device, num_kv_blocks=4096))
    medians = {}
    for n in args.batch_sizes:
        for i in range(n):
            engine.add_request(NewRequest(f"r{n}-{i}", tuple(range(30, 44)),
                                          SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)))
        times = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        medians[n] = statistics.median(times[1:]) * 1000
        print(f"{n:4d} sequences: median decode step {medians[n]:.1f} ms", flush=True)
    print(json.dumps({"size": args.size, "device": str(engine.device), "median_step_ms": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
