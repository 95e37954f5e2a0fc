"""The device check's look at split-K decode (model/triton_attention.py), which the CPU tests run only under Triton's
interpreter. Two parts:
- on a decode step of two sequences over shuffled block tables, the split kernel (a split count that is not a power
  of two, and the count `decode_splits` picks) against the torch path (gather + SDPA), in fp32 and bf16, and with a
  sliding window: the largest |difference|;
- one sequence decoding over a long context at an 8B model's head layout, the kernel unsplit and split as
  `decode_splits` chooses for this GPU: ms a call (one layer; `triton.testing.do_bench`, which flushes the L2 cache
  between calls: the sequence's K/V would otherwise sit in the 50 MB L2).
On a CPU (`--dry-run`) it runs at tiny shapes under the interpreter, with forced splits, or says why it cannot."""

from __future__ import annotations

import os
import time

import torch

FULL_SHAPE = dict(context=8192, block_size=16, heads=(32, 8, 128), splits=6, reps=50)
DRY_SHAPE = dict(context=48, block_size=4, heads=(4, 2, 16), splits=3, reps=2)


def split_decode_check(device: torch.device) -> dict:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "on a CPU the Triton kernel runs only under TRITON_INTERPRET=1"}
    from flotilla.engine.model import triton_attention
    from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention
    from flotilla.engine.model.kv_cache import layer_shape

    shape = FULL_SHAPE if device.type == "cuda" else DRY_SHAPE
    context, block_size, (num_heads, num_kv_heads, head_dim) = shape["context"], shape["block_size"], shape["heads"]
    blocks_long = -(-context // block_size)
    num_blocks = 2 * blocks_long
    generator = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    short = context // 3
    pair = [SeqChunk(context - 1, 1, perm[:blocks_long]), SeqChunk(short - 1, 1, perm[blocks_long:][:-(-short // block_size)])]
    chosen_pair = triton_attention.decode_splits(len(pair), num_kv_heads, context,
                                                 triton_attention._num_multiprocessors(device))
    result: dict = {"context": context, "forced_splits": shape["splits"], "pair_splits_chosen": chosen_pair}
    cases = [(dtype, None) for dtype in ((torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,))]
    cases.append((torch.float32, context // 4))  # a sliding window: each sequence splits only the keys it sees
    for dtype, window in cases:
        cache = torch.randn(layer_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=generator).to(device, dtype)
        q, k, v = (torch.randn(len(pair), heads, head_dim, generator=generator).to(device, dtype)
                   for heads in (num_heads, num_kv_heads, num_kv_heads))
        expected = paged_attention(q, k, v, cache.clone(),
                                   AttentionMetadata.build(pair, block_size, device, sliding_window=window), None, window)
        meta = AttentionMetadata.build(pair, block_size, device, sliding_window=window, use_triton=True)
        paged_attention(q, k, v, cache, meta, None, window)  # writes the step's K/V as the engine would
        name = str(dtype).removeprefix("torch.") + ("" if window is None else "_window")
        for label, splits in (("forced", shape["splits"]), ("chosen", chosen_pair)):
            split = triton_attention.paged_attention(q, cache, meta.block_tables, meta.query_start_loc,
                                                     meta.context_lens, 1, None, window,
                                                     max_context_len=meta.max_context_len, num_splits=splits)
            result[f"max_abs_error_{name}_{label}"] = (split - expected).abs().max().item()
    one = pair[:1]
    meta = AttentionMetadata.build(one, block_size, device, use_triton=True)
    timed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as the engine runs on each
    cache = cache.to(timed_dtype)
    q = torch.randn(1, num_heads, head_dim, generator=generator).to(device, timed_dtype)
    chosen = triton_attention.decode_splits(1, num_kv_heads, context, triton_attention._num_multiprocessors(device))

    def ms_per_call(num_splits: int) -> float:
        def call():
            triton_attention.paged_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 1,
                                             max_context_len=context, num_splits=num_splits)
        if device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(call, warmup=5, rep=100)
        call()  # the interpreter: a wall clock is all there is
        started = time.perf_counter()
        for _ in range(shape["reps"]):
            call()
        return (time.perf_counter() - started) / shape["reps"] * 1e3

    result.update({"batch1_splits_chosen": chosen, "batch1_ms_unsplit": ms_per_call(1),
                   "batch1_ms_split": ms_per_call(max(chosen, 1))})
    return result
