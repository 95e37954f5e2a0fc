"""The device check (`make gpu-check`): the engine on a CUDA GPU against the GPU's floors and transformers.

On random Llama-style checkpoints of real shapes (~1B and ~8B parameters, bf16, drawn on the device) it reports,
in this order (the issue's targets first):
- the device's copy bandwidth and bf16 matmul rate (the floors), and the Triton kernels against the torch path;
- exactness on the 1B: fp32 greedy equal to transformers' fp32 greedy on the same GPU; bf16 greedy agreement with
  transformers' bf16 (and transformers' bf16 with its own fp32, for scale); an fp8 KV cache, with calibrated and
  with unit scales, against the bf16 one (greedy agreement, largest logprob error of the tokens both chose); swap
  preemption to pinned host memory against a run without preemption;
- host synchronisation on the 1B: engine steps (decode, and prefills beside decodes; from CUDA graphs and eagerly)
  under torch's sync debug mode "error", and where the first sync is if one is (loadtest/common/gpu_host_syncs.py);
- on the 8B: decode ms/token at batch 1 against the memory floor (weight bytes read per step / measured copy
  bandwidth), batched decode and prefill tok/s against the compute floor (2 FLOPs per parameter per token at the
  measured bf16 matmul rate), decode with overlap scheduling off and beside a JSON-mode request, and transformers'
  figures on the same workload;
- a small Qwen3-MoE decoding through CUDA graphs against eagerly: the sizes captured, greedy agreement, and decode
  speed each way (loadtest/common/gpu_moe_graphs.py);
- MoE experts grouped (torch._grouped_mm) against the Python loop, whether the grouped way synchronises with the
  host, and both ways' ms a call (loadtest/common/gpu_moe_check.py);
- split-K decode: the split kernel against the torch path, and one sequence over an 8,192-token context unsplit and
  split (loadtest/common/gpu_split_decode.py);
- swap copies on their side stream: swapped-out blocks overwritten and swapped-in blocks read on the compute stream
  at once, staged and unstaged (loadtest/common/gpu_swap_check.py);
- how many times each Triton attention kernel was compiled over the whole check, and the most any one configuration
  of it was (more than 1: a step compiled a kernel again while serving; loadtest/common/gpu_triton_compiles.py).
Targets (reported, never asserted): decode <= 1.3x the memory floor at batch 1, prefill >= 60% of the compute
floor, >= 2x transformers' throughput at batch 64. One JSON line at the end. Needs only torch, triton,
transformers, safetensors, tokenizers and this repository; fetches nothing. Meant to take under 8 minutes on an
H200; it has never run on one, so --budget-s bounds it: a part still running when the budget is spent is stopped
and reported so, the parts after it are skipped, and the JSON line still comes (loadtest/common/timed_sections.py).
--report FILE keeps the report on disk as it grows.

    python loadtest/gpu_check.py              # on a CUDA machine
    make gpu-check GPU_CHECK_ARGS="--report $OUT/gpu-check.json"    # on a lent device (what comes back is $OUT)
    python loadtest/gpu_check.py --dry-run    # every step at tiny shapes on the CPU (its test); no floors met
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file (`make gpu-check`): make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from loadtest.common.device_floors import matmul_tflops, memory_bandwidth_gb_s
from loadtest.common.gpu_exactness import exactness, kernel_check
from loadtest.common.gpu_host_syncs import host_sync_check
from loadtest.common.greedy_compare import agreement
from loadtest.common.gpu_runs import DRY, FULL, free
from loadtest.common.timed_sections import TimedSections
from loadtest.common.gpu_split_decode import split_decode_check
from loadtest.common.gpu_moe_check import moe_grouped_check
from loadtest.common.gpu_moe_graphs import moe_graphs_check
from loadtest.common.gpu_swap_check import swap_stream_check
from loadtest.common.gpu_throughput import engine_performance, floors, transformers_performance
from loadtest.common.gpu_triton_compiles import triton_compiles
from loadtest.common.random_llama import write_random_llama

__all__ = ["agreement", "main"]

NO_CUDA = ("gpu-check: no CUDA device here (torch.cuda.is_available() is False). It measures the engine on a GPU; "
           "run it on a CUDA machine, or with --dry-run for its CPU smoke test.")



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script, not a GPU")
    p.add_argument("--work-dir", type=Path, default=None, help="where the random checkpoints are written")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=450,
                   help="wall-clock seconds for the whole check: when spent, the part running is stopped, the rest "
                        "are skipped, and what was measured is printed (default 450: inside the lent device's "
                        "10-minute command with start-up to spare)")
    p.add_argument("--report", type=Path, default=None,
                   help="also write the report here, rewritten after every part (a kill from outside leaves the "
                        "finished parts behind)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """The parts in the order of what the issue asks first (its targets), so that a budget spent early cuts the
    extras, not them."""
    plan = DRY if args.dry_run else FULL
    device = torch.device("cpu" if args.dry_run else "cuda")
    report: dict = {"check": "gpu", "dry_run": args.dry_run, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "budget_s": args.budget_s}
    with TimedSections(report, args.budget_s, args.report, on_failure=free) as parts, \
            tempfile.TemporaryDirectory(dir=args.work_dir, prefix="gpu-check-") as tmp:
        parts.run("measured", lambda: {"copy_bandwidth_gb_s": memory_bandwidth_gb_s(device, plan.bandwidth_mib),
                                       "bf16_matmul_tflops": matmul_tflops(device, torch.bfloat16, plan.matmul_size)})
        if device.type == "cuda":
            parts.run("kernel", lambda: kernel_check(device))
        checkpoints = _Checkpoints(Path(tmp), device, args.seed)
        parts.run("exactness", lambda: exactness(checkpoints.get(plan.exact_size), device, plan, args.seed))
        parts.run("host_syncs", lambda: host_sync_check(checkpoints.get(plan.exact_size), device, plan, args.seed))
        report["performance"] = performance = {"model": plan.perf_size, "batch": plan.batch}
        measured = report["measured"]
        if "copy_bandwidth_gb_s" in measured:
            performance["floors"] = floors(plan.perf_size, measured["copy_bandwidth_gb_s"],
                                           measured["bf16_matmul_tflops"])
        parts.run("engine", lambda: engine_performance(checkpoints.get(plan.perf_size), device, plan, args.seed),
                  into=performance)
        parts.run("transformers",
                  lambda: transformers_performance(checkpoints.get(plan.perf_size), device, plan, args.seed),
                  into=performance)
        checkpoints.remove()
        targets = _targets(performance)
        if targets is not None:
            report["targets"] = targets
        parts.run("moe_graphs", lambda: moe_graphs_check(device, Path(tmp), args.seed))
        parts.run("moe_grouped", lambda: moe_grouped_check(device))
        parts.run("split_decode", lambda: split_decode_check(device))
        parts.run("swap_streams", lambda: swap_stream_check(device))
    report["triton_compiles"] = triton_compiles()
    report["seconds"] = parts.elapsed()
    report["finished"] = True  # the report file of a check killed from outside lacks it
    parts.save()
    return report


class _Checkpoints:
    """Random Llama checkpoints written when a part first asks for one; one on disk at a time (the 8B is 16 GB)."""

    def __init__(self, work_dir: Path, device: torch.device, seed: int):
        self.work_dir, self.device, self.seed = work_dir, device, seed
        self.size: str | None = None
        self.path: Path | None = None

    def get(self, size: str) -> Path:
        if size != self.size:
            self.remove()
            self.path = write_random_llama(self.work_dir / size, size, self.device, seed=self.seed)
            self.size = size
        return self.path

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        self.size = self.path = None


def _targets(performance: dict) -> dict | None:
    engine, hf, floor = performance.get("engine", {}), performance.get("transformers", {}), performance.get("floors")
    if floor is None or "decode_ms_per_token_batch1" not in engine or "batch_end_to_end_tok_s" not in hf:
        return None
    return {
        "decode_vs_memory_floor": engine["decode_ms_per_token_batch1"] / floor["decode_ms_per_token_memory_floor"],
        "prefill_share_of_compute_floor": engine["prefill_tok_s"] / floor["tok_s_compute_floor"],
        "batch_decode_share_of_compute_floor": engine["decode_tok_s_batch"] / floor["tok_s_compute_floor"],
        "batch_speedup_vs_transformers": engine["batch_end_to_end_tok_s"] / hf["batch_end_to_end_tok_s"],
        "wanted": {"decode_vs_memory_floor": "<= 1.3", "prefill_share_of_compute_floor": ">= 0.6",
                   "batch_speedup_vs_transformers": ">= 2"},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
