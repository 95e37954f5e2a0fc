"""The device check's look at swap copies on their side stream (engine/kv_swap.py), which the CPU tests can only run
synchronously. Each round swaps a request's worth of blocks out, overwrites the freed device blocks on the compute
stream at once, swaps the blocks back into other device blocks and reads them on the compute stream at once: had
the compute stream not waited for the side stream's gather or swap-in, it would overwrite blocks before they were
read, or read them before they landed. Both pools come from allocate_kv_cache, as the engine's do.
Rounds run with staging and without (a swap-out past the staging bound copies straight to the host)."""

from __future__ import annotations

import random

import torch

FULL_SHAPE = dict(layers=32, blocks=96, moved=32, heads=(8, 16, 128), rounds=8)  # 64 MiB a swap in bf16
DRY_SHAPE = dict(layers=2, blocks=12, moved=4, heads=(2, 4, 8), rounds=2)


def swap_stream_check(device: torch.device) -> dict:
    from flotilla.engine import kv_swap
    from flotilla.engine.model.config import ModelConfig
    from flotilla.engine.model.kv_cache import allocate_kv_cache
    from flotilla.engine.scheduler_output import BlockCopy

    shape = FULL_SHAPE if device.type == "cuda" else DRY_SHAPE
    num_kv_heads, block_size, head_dim = shape["heads"]
    # Pools allocated as the engine allocates them (on CUDA the host one locked with cudaHostRegister)
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": num_kv_heads * head_dim,
        "intermediate_size": 32, "num_hidden_layers": shape["layers"], "num_attention_heads": num_kv_heads,
        "num_key_value_heads": num_kv_heads, "max_position_embeddings": 64,
    })
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    device_caches = allocate_kv_cache(config, shape["blocks"], block_size, dtype, device)
    for cache in device_caches:
        cache.copy_(torch.randn(cache.shape, device=device, dtype=dtype))
    host_caches = allocate_kv_cache(config, shape["moved"], block_size, dtype, torch.device("cpu"),
                                    pin_memory=device.type == "cuda")
    swapper = kv_swap.KVSwapper(device_caches, host_caches)
    block_bytes = device_caches[0][:, 0].numel() * device_caches[0].element_size()
    result: dict = {"rounds": shape["rounds"], "bytes_a_swap": shape["moved"] * shape["layers"] * block_bytes}
    saved_bound = kv_swap.STAGING_MAX_BYTES
    try:
        for staged in (True, False):
            kv_swap.STAGING_MAX_BYTES = saved_bound if staged else 0
            mismatched = 0
            for round_index in range(shape["rounds"]):
                rng = random.Random(round_index)
                chosen = rng.sample(range(shape["blocks"]), 2 * shape["moved"])
                out_blocks, in_blocks = chosen[: shape["moved"]], chosen[shape["moved"] :]
                host_blocks = rng.sample(range(shape["moved"]), shape["moved"])
                expected = [cache[:, out_blocks].clone() for cache in device_caches]
                swapper.apply([BlockCopy(d, h) for d, h in zip(out_blocks, host_blocks)], [])
                for cache in device_caches:  # the compute stream reuses the freed blocks at once
                    cache[:, out_blocks] = 0
                swapper.apply([], [BlockCopy(h, d) for h, d in zip(host_blocks, in_blocks)])
                landed = [cache[:, in_blocks].clone() for cache in device_caches]  # read at once, too
                mismatched += sum(not torch.equal(a, b) for a, b in zip(landed, expected))
                for cache in device_caches:  # fresh contents for the next round
                    cache[:, out_blocks] = torch.randn(cache[:, out_blocks].shape, device=device, dtype=dtype)
            result["staged" if staged else "unstaged"] = {"layers_mismatched": mismatched,
                                                          "equal": mismatched == 0}
    finally:
        kv_swap.STAGING_MAX_BYTES = saved_bound
    return result
