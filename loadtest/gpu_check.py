"""The device check (`make gpu-check`): the engine on a CUDA GPU against the GPU's floors and transformers.

On random Llama-style checkpoints of real shapes (~1B and ~8B parameters, bf16, drawn on the device) it reports:
- exactness on the 1B: fp32 greedy equal to transformers' fp32 greedy on the same GPU; bf16 greedy agreement with
  transformers' bf16 (and transformers' bf16 with its own fp32, for scale); an fp8 KV cache against the bf16 one
  (greedy agreement, largest logprob error of the tokens both chose); swap preemption to pinned host memory
  against a run without preemption;
- on the 8B: decode ms/token at batch 1 against the memory floor (weight bytes read per step / measured copy
  bandwidth), batched decode and prefill tok/s against the compute floor (2 FLOPs per parameter per token at the
  measured bf16 matmul rate), and transformers' figures on the same workload.
Targets (reported, never asserted): decode <= 1.3x the memory floor at batch 1, prefill >= 60% of the compute
floor, >= 2x transformers' throughput at batch 64. One JSON line at the end. Needs only torch, triton,
transformers, safetensors, tokenizers and this repository; fetches nothing. Under 8 minutes on an H200.

    python loadtest/gpu_check.py              # on a CUDA machine
    python loadtest/gpu_check.py --dry-run    # every step at tiny shapes on the CPU (its test); no floors met
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a file (`make gpu-check`): make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from loadtest.common.device_floors import matmul_tflops, memory_bandwidth_gb_s
from loadtest.common.random_llama import TOKENIZER_VOCAB, decode_bytes_per_token, num_parameters, write_random_llama

NO_CUDA = ("gpu-check: no CUDA device here (torch.cuda.is_available() is False). It measures the engine on a GPU; "
           "run it on a CUDA machine, or with --dry-run for its CPU smoke test.")


class Plan(NamedTuple):
    exact_size: str
    perf_size: str
    exact_prompts: int
    exact_prompt_len: int
    exact_new_tokens: int
    decode_prompt_len: int
    decode_new_tokens: int
    batch: int
    batch_prompt_len: int
    batch_new_tokens: int
    prefill_requests: int
    prefill_len: int
    bandwidth_mib: int
    matmul_size: int
    kv_bytes: int
    max_model_len: int


FULL = Plan("1b", "8b", 8, 64, 32, 128, 128, 64, 128, 128, 32, 1024, 4096, 8192, 16 << 30, 2048)
DRY = Plan("tiny", "tiny", 2, 16, 6, 8, 8, 4, 8, 8, 4, 32, 64, 256, 64 << 20, 256)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script, not a GPU")
    p.add_argument("--work-dir", type=Path, default=None, help="where the random checkpoints are written")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, TOKENIZER_VOCAB) for _ in range(length)] for _ in range(count)]


def _engine(model_dir: Path, device: torch.device, plan: Plan, **overrides) -> LLMEngine:
    settings = dict(model_dir=str(model_dir), device=device.type, kv_cache_memory_bytes=plan.kv_bytes,
                    max_model_len=plan.max_model_len, max_num_seqs=max(plan.batch, plan.prefill_requests),
                    max_num_batched_tokens=max(2048, plan.prefill_len * 8))
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _greedy_with_logprobs(engine: LLMEngine, prompts, new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0)
    ids = [f"check-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(NewRequest(request_id, tuple(prompt), params))
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            logprobs[output.request_id] += [entry.logprob for entry in output.logprobs]
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


def _hf_model(model_dir: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


@torch.inference_mode()
def _hf_greedy(model, prompts, new_tokens: int, eos: list[int]) -> list[list[int]]:
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0])
        results.append(out[0, len(prompt):].tolist())
    return results


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of b's tokens that a matches before their first difference (1.0: the same greedy text)."""
    matched = total = 0
    for x, y in zip(a, b):
        total += len(y)
        for p, q in zip(x, y):
            if p != q:
                break
            matched += 1
    return matched / max(total, 1)


def _logprob_error(a, a_logprobs, b, b_logprobs) -> float:
    """Largest |logprob difference| over the positions where both runs still chose the same tokens."""
    worst = 0.0
    for x, xl, y, yl in zip(a, a_logprobs, b, b_logprobs):
        for p, pl, q, ql in zip(x, xl, y, yl):
            if p != q:
                break
            worst = max(worst, abs(pl - ql))
    return worst


def exactness(model_dir: Path, device: torch.device, plan: Plan, seed: int) -> dict:
    prompts = _prompts(plan.exact_prompts, plan.exact_prompt_len, seed)
    n = plan.exact_new_tokens
    # A pool that admits every prompt (with the scheduler's 4 lookahead tokens) but cannot hold every finished
    # sequence: requests that grow get swapped out to (pinned) host memory and back.
    block_size, lookahead = 4, 4
    admitted = len(prompts) * -(-(plan.exact_prompt_len + lookahead) // block_size)
    finished = len(prompts) * -(-(plan.exact_prompt_len + n) // block_size)
    swap = {"dtype": "float32", "num_kv_blocks": (admitted + finished) // 2, "block_size": block_size,
            "num_lookahead_steps": lookahead, "preemption_mode": "swap", "num_host_kv_blocks": finished}
    runs, preemptions = {}, {}
    for name, overrides in {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
                            "bf16_fp8kv": {"dtype": "bfloat16", "kv_cache_dtype": "float8_e4m3fn"},
                            "fp32_swap": swap}.items():
        engine = _engine(model_dir, device, plan, cuda_graph_max_batch=plan.exact_prompts, **overrides)
        eos = sorted(engine.tokenizer.eos_token_ids)
        backend = engine.attention_backend
        runs[name] = _greedy_with_logprobs(engine, prompts, n)
        preemptions[name] = engine.stats().num_preemptions
        del engine
        _free()
    hf = {}
    for name, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16}.items():
        model = _hf_model(model_dir, device, dtype)
        hf[name] = _hf_greedy(model, prompts, n, eos)
        del model
        _free()
    return {
        "model": plan.exact_size, "attention_backend": backend, "prompts": len(prompts), "new_tokens": n,
        # how much the comparison says: a degenerate model repeats a few tokens whatever the context
        "distinct_reference_tokens": len({token for tokens in hf["fp32"] for token in tokens}),
        "fp32_greedy_equal": runs["fp32"][0] == hf["fp32"],
        "fp32_agreement": agreement(runs["fp32"][0], hf["fp32"]),
        "bf16_agreement_with_transformers_bf16": agreement(runs["bf16"][0], hf["bf16"]),
        "transformers_bf16_agreement_with_its_fp32": agreement(hf["bf16"], hf["fp32"]),
        "fp8_kv_agreement_with_bf16_kv": agreement(runs["bf16_fp8kv"][0], runs["bf16"][0]),
        "fp8_kv_max_logprob_error": _logprob_error(*runs["bf16_fp8kv"], *runs["bf16"]),
        "swap_preemptions": preemptions["fp32_swap"],
        "swap_agreement_with_fp32": agreement(runs["fp32_swap"][0], runs["fp32"][0]),
    }  # fmt: skip


def _timed_steps(engine: LLMEngine, prompts, new_tokens: int, device: torch.device) -> tuple[list[float], int, float]:
    """Runs prompts to new_tokens each; (seconds of each step, tokens emitted after every request had its first
    one, seconds since then)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(NewRequest(f"perf-{i}-{time.monotonic_ns()}", tuple(prompt), params))
    started_ids: set[str] = set()
    steps, steady_tokens, steady_since = [], 0, None
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        outputs = engine.step()
        _sync(device)
        now = time.perf_counter()
        steps.append(now - began)
        if steady_since is not None:
            steady_tokens += sum(len(o.new_token_ids) for o in outputs)
        started_ids.update(o.request_id for o in outputs)
        if steady_since is None and len(started_ids) == len(prompts):
            steady_since = now
    return steps, steady_tokens, time.perf_counter() - (steady_since or time.perf_counter())


def engine_performance(model_dir: Path, device: torch.device, plan: Plan, seed: int) -> dict:
    engine = _engine(model_dir, device, plan, cuda_graph_max_batch=plan.batch)
    _timed_steps(engine, _prompts(2, plan.decode_prompt_len, seed + 9), 4, device)  # compiles the kernels
    steps, _, _ = _timed_steps(engine, _prompts(1, plan.decode_prompt_len, seed + 1), plan.decode_new_tokens, device)
    decode_ms = statistics.median(steps[1:]) * 1e3
    began = time.perf_counter()
    _, tokens, seconds = _timed_steps(engine, _prompts(plan.batch, plan.batch_prompt_len, seed + 2),
                                      plan.batch_new_tokens, device)
    batch_seconds = time.perf_counter() - began
    prompts = _prompts(plan.prefill_requests, plan.prefill_len, seed + 3)
    began = time.perf_counter()
    _timed_steps(engine, prompts, 1, device)
    prefill_seconds = time.perf_counter() - began
    result = {
        "attention_backend": engine.attention_backend, "dtype": str(engine.dtype).removeprefix("torch."),
        "cuda_graph_sizes": engine.runner.graphs.sizes if engine.runner.graphs is not None else [],
        "decode_ms_per_token_batch1": decode_ms,
        "decode_tok_s_batch": tokens / max(seconds, 1e-9),
        "batch_end_to_end_tok_s": plan.batch * plan.batch_new_tokens / batch_seconds,
        "prefill_tok_s": plan.prefill_requests * plan.prefill_len / prefill_seconds,
    }  # fmt: skip
    del engine
    _free()
    return result


@torch.inference_mode()
def transformers_performance(model_dir: Path, device: torch.device, plan: Plan, seed: int) -> dict:
    model = _hf_model(model_dir, device, torch.bfloat16)

    def generate(prompts, new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)
        _sync(device)
        began = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - began

    generate(_prompts(1, plan.decode_prompt_len, seed + 9), 4)  # warm-up
    one = _prompts(1, plan.decode_prompt_len, seed + 1)
    decode_ms = (generate(one, plan.decode_new_tokens) - generate(one, 1)) / (plan.decode_new_tokens - 1) * 1e3
    batch_seconds = generate(_prompts(plan.batch, plan.batch_prompt_len, seed + 2), plan.batch_new_tokens)
    prompts = torch.tensor(_prompts(plan.prefill_requests, plan.prefill_len, seed + 3), device=device)
    _sync(device)
    began = time.perf_counter()
    for chunk in prompts.split(8):
        model(chunk, logits_to_keep=1)
    _sync(device)
    prefill_seconds = time.perf_counter() - began
    del model
    _free()
    return {
        "decode_ms_per_token_batch1": decode_ms,
        "batch_end_to_end_tok_s": plan.batch * plan.batch_new_tokens / batch_seconds,
        "prefill_tok_s": plan.prefill_requests * plan.prefill_len / prefill_seconds,
    }


def floors(size: str, bandwidth_gb_s: float, matmul: float) -> dict:
    """Every token goes through every matrix once (an untied embedding is a lookup: not counted, as in
    bench_engine.py); attention-score FLOPs are not counted, so the compute floor is a little optimistic."""
    weight_bytes = decode_bytes_per_token(size)
    matmul_params = weight_bytes // 2
    return {
        "parameters": num_parameters(size),
        "parameters_in_matmuls": matmul_params,
        "decode_ms_per_token_memory_floor": weight_bytes / (bandwidth_gb_s * 1e9) * 1e3,
        "tok_s_compute_floor": matmul * 1e12 / (2 * matmul_params),
    }


def kernel_check(device: torch.device) -> dict:
    """The Triton kernel against the torch path on one mixed step (decodes, a prefill, a chunk after a cached
    prefix) with shuffled block tables, at an 8B model's head layout, in fp32 and bf16: largest |difference|."""
    from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention

    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_heads, num_kv_heads, head_dim = 256, 16, 32, 8, 128
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    seqs = [SeqChunk(300, 1, perm[0:20]), SeqChunk(0, 1, perm[20:21]), SeqChunk(0, 200, perm[21:34]),
            SeqChunk(500, 77, perm[34:71]), SeqChunk(1000, 1, perm[71:134])]
    num_tokens = sum(seq.num_tokens for seq in seqs)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(device, dtype)
        q, k, v = (torch.randn(num_tokens, heads, head_dim, generator=generator).to(device, dtype)
                   for heads in (num_heads, num_kv_heads, num_kv_heads))
        outputs = [paged_attention(q, k, v, cache.clone(),
                                   AttentionMetadata.build(seqs, block_size, device, use_triton=use_triton))
                   for use_triton in (False, True)]
        result[f"max_abs_error_{str(dtype).removeprefix('torch.')}"] = (outputs[1] - outputs[0]).abs().max().item()
    return result


def _section(report: dict, name: str, run_section):
    """Runs one part of the check; a failure is reported in its place and the rest still runs."""
    try:
        report[name] = run_section()
    except Exception as error:  # noqa: BLE001 - one device run has to report everything it can
        report[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        _free()
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
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix="gpu-check-") as tmp:
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
