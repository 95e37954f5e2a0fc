"""The device check's exactness parts: the Triton kernel against the torch path on the GPU, and greedy runs of
the engine (fp32, bf16, fp8 KV, swap preemption) against transformers and each other."""

from __future__ import annotations

from pathlib import Path

import torch

from flotilla.engine.model.kv_cache import layer_shape
from loadtest.common.greedy_compare import agreement, greedy_with_logprobs, logprob_errors, transformers_greedy
from loadtest.common.gpu_runs import Plan, free, hf_model, random_prompts, start_engine


def exactness(model_dir: Path, device: torch.device, plan: Plan, seed: int) -> dict:
    prompts = random_prompts(plan.exact_prompts, plan.exact_prompt_len, seed)
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
                            "bf16_fp8kv_unit": {"dtype": "bfloat16", "kv_cache_dtype": "float8_e4m3fn",
                                                "kv_cache_scales": "unit"},
                            "fp32_swap": swap}.items():
        engine = start_engine(model_dir, device, plan, cuda_graph_max_batch=plan.exact_prompts, **overrides)
        eos = sorted(engine.tokenizer.eos_token_ids)
        backend = engine.attention_backend
        runs[name] = greedy_with_logprobs(engine, prompts, n)
        preemptions[name] = engine.stats().num_preemptions
        del engine
        free()
    hf = {}
    for name, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16}.items():
        model = hf_model(model_dir, device, dtype)
        hf[name] = transformers_greedy(model, prompts, n, eos)
        del model
        free()
    return {
        "model": plan.exact_size, "attention_backend": backend, "prompts": len(prompts), "new_tokens": n,
        # how much the comparison says: a degenerate model repeats a few tokens whatever the context
        "distinct_reference_tokens": len({token for tokens in hf["fp32"] for token in tokens}),
        "fp32_greedy_equal": runs["fp32"][0] == hf["fp32"],
        "fp32_agreement": agreement(runs["fp32"][0], hf["fp32"]),
        "bf16_agreement_with_transformers_bf16": agreement(runs["bf16"][0], hf["bf16"]),
        "transformers_bf16_agreement_with_its_fp32": agreement(hf["bf16"], hf["fp32"]),
        "fp8_kv_agreement_with_bf16_kv": agreement(runs["bf16_fp8kv"][0], runs["bf16"][0]),
        "fp8_kv_max_logprob_error": max(logprob_errors(runs["bf16_fp8kv"], runs["bf16"]), default=0.0),
        "fp8_kv_unit_scales_agreement_with_bf16_kv": agreement(runs["bf16_fp8kv_unit"][0], runs["bf16"][0]),
        "fp8_kv_unit_scales_max_logprob_error": max(logprob_errors(runs["bf16_fp8kv_unit"], runs["bf16"]),
                                                    default=0.0),
        "swap_preemptions": preemptions["fp32_swap"],
        "swap_agreement_with_fp32": agreement(runs["fp32_swap"][0], runs["fp32"][0]),
    }  # fmt: skip


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
        shape = layer_shape(num_blocks, block_size, num_kv_heads, head_dim)
        cache = torch.randn(shape, generator=generator).to(device, dtype)
        q, k, v = (torch.randn(num_tokens, heads, head_dim, generator=generator).to(device, dtype)
                   for heads in (num_heads, num_kv_heads, num_kv_heads))
        outputs = [paged_attention(q, k, v, cache.clone(),
                                   AttentionMetadata.build(seqs, block_size, device, use_triton=use_triton))
                   for use_triton in (False, True)]
        result[f"max_abs_error_{str(dtype).removeprefix('torch.')}"] = (outputs[1] - outputs[0]).abs().max().item()
    return result
