"""What the batch hold changes inside one engine, without the fleet's processes around it: the time from adding an
interactive prompt to its first token while --batch-seqs batch-class sequences decode, with hold_batch on and off
(toggled on the same LLMEngine, probes alternating, so both see the same machine).

Each probe: a --probe-tokens prompt (max_tokens 1) added between two steps; its TTFT is the wall time of the steps
until its token comes back. The batch sequences are topped up so that --batch-seqs of them always decode.
Prints median and p95 TTFT per (batch size, hold) and, last, ONE JSON line.

  OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_batch_hold.py
"""

from __future__ import annotations

import argparse
import itertools
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
    from flotilla.engine.request import Priority
    from flotilla.engine.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("micro", "tiny", "small"), default="tiny")
    p.add_argument("--batch-seqs", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--probe-tokens", type=int, nargs="+", default=[8, 256])
    p.add_argument("--probes", type=int, default=40, help="per (batch size, probe length, hold)")
    args = p.parse_args(argv)
    model_dir = ensure_checkpoint(Path.home() / ".cache" / "flotilla" / "bench", args.size)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), num_kv_blocks=8192, target_tpot_s=None))
    ids = itertools.count()
    batch_params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
    probe_params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)

    def top_up(n: int) -> None:
        while engine.scheduler.num_running + engine.scheduler.num_waiting < n:
            i = next(ids)
            engine.add_request(NewRequest(f"b{i}", tuple(range(30 + i % 50, 44 + i % 50)), batch_params,
                                          priority=Priority.BATCH))

    def probe(length: int) -> float:
        request_id = f"p{next(ids)}"
        engine.add_request(NewRequest(request_id, tuple((7 + next(ids) + k) % 900 for k in range(length)),
                                      probe_params))
        started = time.perf_counter()
        while not any(o.request_id == request_id for o in engine.step()):
            pass
        return time.perf_counter() - started

    results = []
    for n, length in itertools.product(args.batch_seqs, args.probe_tokens):
        ttfts: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * args.probes):
            hold = i % 2 == 0
            engine.scheduler.config.hold_batch = hold
            top_up(n)
            for _ in range(3):  # the batch decoding, not prefilling, when the probe comes
                engine.step()
                top_up(n)
            ttfts[hold].append(probe(length))
        for hold in (False, True):
            values = sorted(ttfts[hold])
            row = {"batch_seqs": n, "probe_tokens": length, "hold_batch": hold,
                   "ttft_p50_ms": statistics.median(values) * 1000,
                   "ttft_p95_ms": statistics.quantiles(values, n=20, method="inclusive")[-1] * 1000}
            results.append(row)
            print(f"{n:3d} batch seqs, {length:4d}-token probe, hold {'on ' if hold else 'off'}: TTFT p50 "
                  f"{row['ttft_p50_ms']:.1f} ms p95 {row['ttft_p95_ms']:.1f} ms", flush=True)
    print(json.dumps({"size": args.size, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
