"""The device check (`make gpu-check`): the engine on a CUDA GPU against the GPU's floors and transformers.

On random Llama-style checkpoints of real shapes (~1B and ~8B parameters, bf16, drawn on the device) it reports:
- split-K decode: the split kernel against the torch path, and one sequence over an 8,192-token context unsplit and
  split (loadtest/common/gpu_split_decode.py);
- swap copies on their side stream: swapped-out blocks overwritten and swapped-in blocks read on the compute stream
  at once, staged and unstaged (loadtest/common/gpu_swap_check.py);
- MoE experts grouped (torch._grouped_mm) against the Python loop, whether the grouped way synchronises with the
  host, and both ways' ms a call (loadtest/common/gpu_moe_check.py);
- a small Qwen3-MoE decoding through CUDA graphs against eagerly: the sizes captured, greedy agreement, and decode
  speed each way (loadtest/common/gpu_moe_graphs.py);
- exactness on the 1B: fp32 greedy equal to transformers' fp32 greedy on the same GPU; bf16 greedy agreement with
  transformers' bf16 (and transformers' bf16 with its own fp32, for scale); an fp8 KV cache, with calibrated and
  with unit scales, against the bf16 one (greedy agreement, largest logprob error of the tokens both chose); swap
  preemption to pinned host memory against a run without preemption;
- on the 8B: decode ms/token at batch 1 against the memory floor (weight bytes read per step / measured copy
  bandwidth), batched decode and prefill tok/s against the compute floor (2 FLOPs per parameter per token at the
  measured bf16 matmul rate), decode with overlap scheduling off and beside a JSON-mode request, and transformers'
  figures on the same workload.
Targets (reported, never asserted): decode <= 1.3x the memory floor at batch 1, prefill >= 60% of the compute
floor, >= 2x transformers' throughput at batch 64. One JSON line at the end. Needs only torch, triton,
transformers, safetensors, tokenizers and this repository; fetches nothing. Under 8 minutes on an H200.

    python loadtest/gpu_check.py              # on a CUDA machine
    python loadtest/gpu_check.py --dry-run    # every step at tiny shapes on the CPU (its test); no floors met
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file (`make gpu-check`): make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from loadtest.common.device_floors import matmul_tflops, memory_bandwidth_gb_s
from loadtest.common.gpu_exactness import exactness, kernel_check
from loadtest.common.greedy_compare import agreement
from loadtest.common.gpu_runs import DRY, FULL, free
from loadtest.common.gpu_split_decode import split_decode_check
from loadtest.common.gpu_moe_check import moe_grouped_check
from loadtest.common.gpu_moe_graphs import moe_graphs_check
from loadtest.common.gpu_swap_check import swap_stream_check
from loadtest.common.gpu_throughput import engine_performance, floors, transformers_performance
from loadtest.common.random_llama import write_random_llama

__all__ = ["agreement", "main"]

NO_CUDA = ("gpu-check: no CUDA device here (torch.cuda.is_available() is False). It measures the engine on a GPU; "
           "run it on a CUDA machine, or with --dry-run for its CPU smoke test.")



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script, not a GPU")
    p.add_argument("--work-dir", type=Path, default=None, help="where the random checkpoints are written")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _section(report: dict, name: str, run_section):
    """Runs one part of the check; a failure is reported in its place and the rest still runs."""
    try:
        report[name] = run_section()
    except Exception as error:  # noqa: BLE001 - one device run has to report everything it can
        report[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        free()
    return report[name]


def run(args: argparse.Namespace) -> dict:
    plan = DRY if args.dry_run else FULL
    device = torch.device("cpu" if args.dry_run else "cuda")
    started = time.perf_counter()
    report: dict = {"check": "gpu", "dry_run": args.dry_run, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    bandwidth = memory_bandwidth_gb_s(device, plan.bandwidth_mib)
    matmul = matmul_tflops(device, torch.bfloat16, plan.matmul_size)
    report["measured"] = {"copy_bandwidth_gb_s": bandwidth, "bf16_matmul_tflops": matmul}
    if device.type == "cuda":
        _section(report, "kernel", lambda: kernel_check(device))
    _section(report, "split_decode", lambda: split_decode_check(device))
    _section(report, "swap_streams", lambda: swap_stream_check(device))
    _section(report, "moe_grouped", lambda: moe_grouped_check(device))
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix="gpu-check-") as tmp:
        _section(report, "moe_graphs", lambda: moe_graphs_check(device, Path(tmp), args.seed))
        shutil.rmtree(Path(tmp) / "qwen3-moe", ignore_errors=True)
        exact_dir = write_random_llama(Path(tmp) / plan.exact_size, plan.exact_size, device, seed=args.seed)
        _section(report, "exactness", lambda: exactness(exact_dir, device, plan, args.seed))
        perf_dir = exact_dir
        if plan.perf_size != plan.exact_size:
            shutil.rmtree(exact_dir)
            perf_dir = write_random_llama(Path(tmp) / plan.perf_size, plan.perf_size, device, seed=args.seed)
        floor = floors(plan.perf_size, bandwidth, matmul)
        performance = {"model": plan.perf_size, "batch": plan.batch, "floors": floor}
        engine = _section(performance, "engine", lambda: engine_performance(perf_dir, device, plan, args.seed))
        hf = _section(performance, "transformers",
                      lambda: transformers_performance(perf_dir, device, plan, args.seed))
    report["performance"] = performance
    if "error" not in engine and "error" not in hf:
        report["targets"] = {
            "decode_vs_memory_floor": engine["decode_ms_per_token_batch1"] / floor["decode_ms_per_token_memory_floor"],
            "prefill_share_of_compute_floor": engine["prefill_tok_s"] / floor["tok_s_compute_floor"],
            "batch_decode_share_of_compute_floor": engine["decode_tok_s_batch"] / floor["tok_s_compute_floor"],
            "batch_speedup_vs_transformers": engine["batch_end_to_end_tok_s"] / hf["batch_end_to_end_tok_s"],
            "wanted": {"decode_vs_memory_floor": "<= 1.3", "prefill_share_of_compute_floor": ">= 0.6",
                       "batch_speedup_vs_transformers": ">= 2"},
        }  # fmt: skip
    report["seconds"] = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
