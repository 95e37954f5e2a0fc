"""Where an engine step's time goes: torch.profiler over a prefill-heavy and a decode-heavy step of the bench
workload's shapes, each op's self time put in one of matmul / attention / element-wise / other, and the rest
of the step's wall time (Python: scheduler, metadata, sampling, module calls) as overhead. The C kernels (ctypes
calls) are labelled: fused_ops::* counts as element-wise (its K/V cache writes, write_rows, as attention),
decode_kernel::* and prefill_kernel::* as attention, panel_gemm::matmul (the engine's own linears; a gate/up one
applies SiLU x up too) as matmul. Prints one JSON object.

    python loadtest/profile_engine.py --size small --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# As bench_engine.py and the `flotilla` command's workers (before torch loads OpenMP): spinning OpenMP threads on
# shared cores would profile the spinning, not the engine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.model import decode_kernel
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.models.checkpoint import SIZES
from loadtest.common.checkpoint_cache import default_cache_dir, ensure_checkpoint

MATMUL = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise",
          "panel_gemm::matmul")
ATTENTION = ("sdpa", "scaled_dot_product", "flash_attention", "index_select", "index_copy", "index_put",
             "decode_kernel", "prefill_kernel", "_softmax", "write_rows")  # write_rows: the K/V cache writes
OTHER = ("aten::argmax", "aten::embedding", "aten::index", "aten::sort", "aten::max", "aten::sum",
         "aten::tensor", "aten::to", "aten::copy_", "aten::_to_copy", "aten::lift_fresh", "aten::empty")


def category(name: str) -> str:
    lowered = name.lower()
    if name in MATMUL:
        return "matmul"
    if any(key in lowered for key in ATTENTION):
        return "attention"
    if name.startswith("fused_ops::"):
        return "elementwise"
    if name.startswith("aten::") and name not in OTHER:
        return "elementwise"
    return "other"


def _label_kernels() -> None:
    """The C kernels are ctypes calls, invisible to the profiler: give each a named range of its own."""
    try:
        from flotilla.engine.model import fused_ops
    except ImportError:  # an engine from before the fused element-wise kernels (A/B against an older checkout)
        fused_ops = None
    try:
        from flotilla.engine.model import prefill_kernel
    except ImportError:  # an engine from before the prefill kernel
        prefill_kernel = None
    try:
        from flotilla.engine.model import panel_gemm
    except ImportError:  # an engine from before its own matmul
        panel_gemm = None
    kernels = [(decode_kernel, ("paged_decode_attention",))]
    if panel_gemm is not None:
        kernels.append((panel_gemm, ("matmul",)))
    if prefill_kernel is not None:  # the batched entry point (one call per layer) is newer than the kernel
        kernels.append((prefill_kernel, tuple(name for name in ("paged_prefill_attention",
                                                                "paged_prefill_attention_batch")
                                              if hasattr(prefill_kernel, name))))
    if fused_ops is not None:
        kernels.append((fused_ops, tuple(name for name in ("rms_norm", "add_rms_norm", "silu_mul", "rope_in_place",
                                                           "write_rows") if hasattr(fused_ops, name))))
    for module, names in kernels:
        for name in names:
            setattr(module, name, _labelled(f"{module.__name__.rsplit('.', 1)[-1]}::{name}", getattr(module, name)))


def _labelled(label: str, function):
    def call(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)
    return call


def profile_steps(engine: LLMEngine, num_steps: int) -> dict:
    """Self CPU time per category over num_steps engine steps, as shares of their wall time."""
    totals = dict.fromkeys(("matmul", "attention", "elementwise", "other"), 0.0)
    wall = 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            started = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - started
    for event in prof.key_averages():
        totals[category(event.key)] += event.self_cpu_time_total / 1e6
    shares = {name: round(seconds / wall, 3) for name, seconds in totals.items()}
    shares["python_and_scheduler"] = round(max(0.0, 1 - sum(totals.values()) / wall), 3)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"wall_ms_per_step": round(wall * 1e3 / num_steps, 1), "shares": shares,
            "top_ops_ms_per_step": {e.key: round(e.self_cpu_time_total / 1e3 / num_steps, 2) for e in top},
}


def submit(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(NewRequest(f"p{i}-{time.monotonic_ns()}", tuple(prompt), params))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=3, help="steps profiled of each kind")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-keep-freed-host-memory", action="store_true", help="glibc's defaults, for an A/B run")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _label_kernels()
    model_dir = str(ensure_checkpoint(default_cache_dir(), args.size))
    rng = random.Random(0)
    vocab = 1000
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=4096,
                                    max_num_batched_tokens=2048,
                                    keep_freed_host_memory=not args.no_keep_freed_host_memory))
    submit(engine, [[rng.randrange(10, vocab) for _ in range(8)]], 2)
    while engine.has_unfinished_requests():
        engine.step()
    # prefill-heavy: 4 x 512-token prompts per 2048-token step
    submit(engine, [[rng.randrange(10, vocab) for _ in range(512)] for _ in range(4 * args.steps)], 4)
    prefill = profile_steps(engine, args.steps)
    while engine.has_unfinished_requests():
        engine.step()
    # decode-heavy: 64 sequences of ~400 tokens' context, one token each per step
    submit(engine, [[rng.randrange(10, vocab) for _ in range(rng.randrange(300, 500))] for _ in range(64)], 64)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler._running):
        engine.step()
    decode = profile_steps(engine, args.steps)
    summary = {"size": args.size, "threads": torch.get_num_threads(), "prefill_2048_tokens": prefill,
               "decode_64_seqs": decode}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
