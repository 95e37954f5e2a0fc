"""Llama-family and Gemma 2/3 decoders over a paged KV cache, loaded from Hugging Face checkpoints."""

from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.gemma import GemmaForCausalLM
from flotilla.engine.model.kv_cache import allocate_kv_cache, copy_blocks, kv_pool_tensor, num_blocks_for_budget
from flotilla.engine.model.llama import LlamaForCausalLM
from flotilla.engine.model.loader import load_model

__all__ = [
    "AttentionMetadata",
    "GemmaForCausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "SeqChunk",
    "allocate_kv_cache",
    "copy_blocks",
    "kv_pool_tensor",
    "load_model",
    "num_blocks_for_budget",
    "paged_attention",
]
