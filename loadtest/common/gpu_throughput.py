"""The device check's speed parts: the engine and transformers on one workload, and the GPU's floors for it."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.structured_output import StructuredOutput
from loadtest.common.gpu_runs import Plan, free, hf_model, random_prompts, start_engine, sync
from loadtest.common.random_llama import decode_bytes_per_token, num_parameters


# Any JSON object: the grammar request beside a batch (the random model's output decides how long it runs).
JSON_OBJECT = StructuredOutput("json", '{"type": "object"}')


def _timed_steps(engine: LLMEngine, prompts, new_tokens: int, device: torch.device,
                 first_structured: StructuredOutput | None = None) -> tuple[list[float], int, float]:
    """Runs prompts to new_tokens each (the first under `first_structured`, if given); (seconds between one step()
    returning and the next, tokens emitted after every request had its first one, seconds since then). No
    synchronisation between steps: with overlap a call returns while the step it launched runs, and waiting for it
    there would time the steps one after the other."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        own = params if i or first_structured is None else replace(params, structured_output=first_structured)
        engine.add_request(NewRequest(f"perf-{i}-{time.monotonic_ns()}", tuple(prompt), own))
    sync(device)
    started_ids: set[str] = set()
    steps, steady_tokens, steady_since = [], 0, None
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(now - began)
        if steady_since is not None:
            steady_tokens += sum(len(o.new_token_ids) for o in outputs)
        started_ids.update(o.request_id for o in outputs)
        if steady_since is None and len(started_ids) == len(prompts):
            steady_since = now
    return steps, steady_tokens, time.perf_counter() - (steady_since or time.perf_counter())


def engine_performance(model_dir: Path, device: torch.device, plan: Plan, seed: int) -> dict:
    engine = start_engine(model_dir, device, plan, cuda_graph_max_batch=plan.batch)
    engine.overlap_output_processing = True  # the CUDA default, set so that a dry run on a CPU takes this path too
    _timed_steps(engine, random_prompts(2, plan.decode_prompt_len, seed + 9), 4, device)  # compiles the kernels
    decode = decode_runs(engine, plan, seed + 1, seed + 2, device)
    prompts = random_prompts(plan.prefill_requests, plan.prefill_len, seed + 3)
    began = time.perf_counter()
    _timed_steps(engine, prompts, 1, device)
    prefill_seconds = time.perf_counter() - began
    result = {
        "attention_backend": engine.attention_backend, "dtype": str(engine.dtype).removeprefix("torch."),
        "cuda_graph_sizes": engine.runner.graphs.sizes if engine.runner.graphs is not None else [],
        "decode_ms_per_token_batch1": decode["decode_ms_per_token_batch1"],
        "decode_tok_s_batch": decode["decode_tok_s_batch"],
        "batch_end_to_end_tok_s": plan.batch * plan.batch_new_tokens / decode["batch_seconds"],
        "prefill_tok_s": plan.prefill_requests * plan.prefill_len / prefill_seconds,
        "overlap_off": _decode_without_overlap(engine, plan, seed, device),
        "beside_a_grammar": _decode_beside_a_grammar(engine, plan, seed, device),
    }  # fmt: skip
    del engine
    free()
    return result


def decode_runs(engine: LLMEngine, plan: Plan, seed_one: int, seed_batch: int, device: torch.device) -> dict:
    """One sequence decoding (median ms a step), then a batch (tok/s once every request had its first token, and
    the batch's seconds end to end)."""
    steps, _, _ = _timed_steps(engine, random_prompts(1, plan.decode_prompt_len, seed_one), plan.decode_new_tokens,
                               device)
    began = time.perf_counter()
    _, tokens, seconds = _timed_steps(engine, random_prompts(plan.batch, plan.batch_prompt_len, seed_batch),
                                      plan.batch_new_tokens, device)
    return {"decode_ms_per_token_batch1": statistics.median(steps[1:]) * 1e3,
            "decode_tok_s_batch": tokens / max(seconds, 1e-9), "batch_seconds": time.perf_counter() - began}


def _decode_without_overlap(engine: LLMEngine, plan: Plan, seed: int, device: torch.device) -> dict:
    """The decode runs again with each step read back before the next is scheduled (overlap_output_processing off):
    what the overlap saves is the difference."""
    engine.overlap_output_processing = False
    decode = decode_runs(engine, plan, seed + 4, seed + 5, device)
    engine.overlap_output_processing = True
    return {key: decode[key] for key in ("decode_ms_per_token_batch1", "decode_tok_s_batch")}


def _decode_beside_a_grammar(engine: LLMEngine, plan: Plan, seed: int, device: torch.device) -> dict:
    """The batch with its first request in JSON mode, overlap on and off (tok/s once every request had its first
    token). A step with grammar rows is launched up to its logits and sampled once the step before is read, so one
    such request no longer takes the whole batch off overlap."""
    result = {}
    for overlap in (True, False):
        engine.overlap_output_processing = overlap
        _, tokens, seconds = _timed_steps(engine, random_prompts(plan.batch, plan.batch_prompt_len, seed + 6),
                                          plan.batch_new_tokens, device, JSON_OBJECT)
        result[f"decode_tok_s_batch_overlap_{'on' if overlap else 'off'}"] = tokens / max(seconds, 1e-9)
    engine.overlap_output_processing = True
    return result


@torch.inference_mode()
def transformers_performance(model_dir: Path, device: torch.device, plan: Plan, seed: int) -> dict:
    model = hf_model(model_dir, device, torch.bfloat16)

    def generate(prompts, new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)
        sync(device)
        began = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - began

    generate(random_prompts(1, plan.decode_prompt_len, seed + 9), 4)  # warm-up
    one = random_prompts(1, plan.decode_prompt_len, seed + 1)
    decode_ms = (generate(one, plan.decode_new_tokens) - generate(one, 1)) / (plan.decode_new_tokens - 1) * 1e3
    batch_seconds = generate(random_prompts(plan.batch, plan.batch_prompt_len, seed + 2), plan.batch_new_tokens)
    prompts = torch.tensor(random_prompts(plan.prefill_requests, plan.prefill_len, seed + 3), device=device)
    sync(device)
    began = time.perf_counter()
    for chunk in prompts.split(8):
        model(chunk, logits_to_keep=1)
    sync(device)
    prefill_seconds = time.perf_counter() - began
    del model
    free()
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
