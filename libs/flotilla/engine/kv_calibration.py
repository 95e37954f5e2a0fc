"""The calibration pass of an fp8 KV cache's scales (model/kv_scales.py), run once at start-up, before any request
and before CUDA graphs capture the scales as constants."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flotilla.engine.model.attention import AttentionMetadata, SeqChunk
from flotilla.engine.model.kv_cache import allocate_kv_cache
from flotilla.engine.model.kv_scales import KVScales, RangeRecorder
from flotilla.engine.model.llama import LlamaForCausalLM


@torch.inference_mode()
def calibrate_kv_scales(model: LlamaForCausalLM, token_ids: Sequence[int], model_dtype: torch.dtype,
                        kv_dtype: torch.dtype, block_size: int, device: torch.device) -> list[KVScales]:
    """Run `token_ids` as one prefill through the model with a scratch cache in the model's dtype, record each
    layer's largest |K| and |V|, and return each layer's scales for `kv_dtype` (the engine sets them on the
    attention modules)."""
    if not token_ids:
        raise ValueError("the calibration pass needs at least one token")
    attentions = [layer.self_attn for layer in model.model.layers]
    recorder = RangeRecorder(len(attentions))
    num_blocks = -(-len(token_ids) // block_size)
    scratch = allocate_kv_cache(model.config, num_blocks, block_size, model_dtype, device)
    meta = AttentionMetadata.build([SeqChunk(0, len(token_ids), list(range(num_blocks)))], block_size, device,
                                   sliding_window=model.config.sliding_window)
    input_ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    positions = torch.arange(len(token_ids), dtype=torch.int64, device=device)
    for attention in attentions:
        attention.range_recorder = recorder
    try:
        model(input_ids, positions, meta, scratch)
    finally:
        for attention in attentions:
            attention.range_recorder = None
    return recorder.scales(kv_dtype)
