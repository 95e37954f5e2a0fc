"""The device check's MoE decode through CUDA graphs (engine/cuda_graphs.py). Graphs are captured for a MoE model
only where its experts were settled grouped (sm90+ in bf16: fixed shapes, routing read on the device), so this
part has never run anywhere but here. A small random Qwen3-MoE in bf16 is served twice on the GPU, with decode
graphs (the default) and with `cuda_graphs` off, and it reports:
- the way the experts were settled, the batch sizes captured, and whether overlap scheduling is on;
- greedy agreement between the two runs on the same prompts (bf16: a graph's fixed split-K and padded batch may
  round differently from an eager step, so agreement, not equality);
- decode ms a step at batch 1 and tok/s at batch 16, each way (graphs exist to cut the first).
--dry-run (CPU, float32, tiny shapes): the same steps without graphs, to check the script."""

from __future__ import annotations

from pathlib import Path

import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.models.atomic_files import write_json, write_text
from flotilla.models.toy_tokenizer import toy_tokenizer_json
from loadtest.common.greedy_compare import agreement, greedy_with_logprobs
from loadtest.common.gpu_runs import DRY, FULL, free, random_prompts
from loadtest.common.gpu_throughput import decode_runs
from loadtest.common.random_llama import TOKENIZER_VOCAB

# Qwen3-30B-A3B's layer in miniature: 64 experts (it has 128), top 8, 512 wide (768), hidden 1,024 (2,048); rows
# 16-byte aligned in bf16 so that the grouped call fits. ~0.64B parameters in bf16.
FULL_MOE = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2048)
DRY_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128)
# Decode runs: batch-1 prompt / new tokens, batch, batch prompt / new tokens, KV bytes
FULL_RUNS = FULL._replace(decode_prompt_len=128, decode_new_tokens=64, batch=16, batch_prompt_len=128,
                          batch_new_tokens=64, kv_bytes=4 << 30)


def write_random_qwen3_moe(out_dir: Path, shape: dict, device: torch.device, seed: int = 0) -> Path:
    """A Qwen3-MoE checkpoint of `shape` with random weights (std 0.02, norms near 1), in the engine's dtype
    on `device`, and the project's toy tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = Qwen3MoeConfig(vocab_size=TOKENIZER_VOCAB, max_position_embeddings=4096, norm_topk_prob=True,
                            tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # drawn here, not left to transformers' init of the fused experts
        for name, weight in model.named_parameters():
            weight.normal_(1.0, 0.05) if name.endswith("norm.weight") else weight.normal_(0.0, 0.02)
    model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_text(out_dir / "tokenizer.json", toy_tokenizer_json(TOKENIZER_VOCAB))
    write_json(out_dir / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
    del model
    free()
    return out_dir


def moe_graphs_check(device: torch.device, work_dir: Path, seed: int = 0) -> dict:
    shape, runs = (FULL_MOE, FULL_RUNS) if device.type == "cuda" else (DRY_MOE, DRY)
    model_dir = write_random_qwen3_moe(work_dir / "qwen3-moe", shape, device, seed)
    prompts = random_prompts(8, 64, seed + 11)
    result: dict = {"shape": shape}
    tokens = {}
    for way, graphs in (("graphs", True), ("eager", False)):
        engine = LLMEngine(EngineConfig(model_dir=str(model_dir), device=device.type, cuda_graphs=graphs,
                                        max_model_len=1024, max_num_seqs=runs.batch,
                                        kv_cache_memory_bytes=runs.kv_bytes))
        result[f"{way}_experts_grouped"] = engine.moe_grouped
        result[f"{way}_overlap"] = engine.overlap_output_processing
        result[f"{way}_cuda_graph_sizes"] = engine.runner.graphs.sizes if engine.runner.graphs is not None else []
        tokens[way], _ = greedy_with_logprobs(engine, prompts, 32, ignore_eos=True)  # also compiles the kernels
        decode = decode_runs(engine, runs, seed + 1, seed + 2, device)
        result[f"{way}_decode_ms_per_token_batch1"] = decode["decode_ms_per_token_batch1"]
        result[f"{way}_decode_tok_s_batch{runs.batch}"] = decode["decode_tok_s_batch"]
        del engine
        free()
    result["greedy_agreement_graphs_vs_eager"] = agreement(tokens["graphs"], tokens["eager"])
    return result
