"""Swap preemption's block copies (engine/kv_swap.py): runs, and the order that lets a step reuse the device
blocks a swap-out freed. On a CPU the copies run at once; the CUDA side stream is exercised by `make gpu-check`
(swap preemption against a run without it)."""

from __future__ import annotations

import pytest
import torch

from flotilla.engine import kv_swap
from flotilla.engine.kv_swap import BlockRun, KVSwapper, block_runs
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.kv_cache import allocate_kv_cache
from flotilla.engine.scheduler_output import BlockCopy

CONFIG = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
})
CPU = torch.device("cpu")


def test_block_runs_merge_pairs_that_continue_on_both_sides():
    assert block_runs([]) == []
    assert block_runs([(3, 0), (4, 1), (5, 2), (9, 7), (10, 8), (12, 9), (11, 10)]) == [
        BlockRun(3, 0, 3), BlockRun(9, 7, 2), BlockRun(12, 9, 1), BlockRun(11, 10, 1)]
    # consecutive on one side only: separate runs
    assert block_runs([(0, 5), (1, 7), (2, 6)]) == [BlockRun(0, 5, 1), BlockRun(1, 7, 1), BlockRun(2, 6, 1)]


def _pools(num_device_blocks=12, num_host_blocks=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    device = allocate_kv_cache(CONFIG, num_device_blocks, 2, torch.float32, CPU)
    host = allocate_kv_cache(CONFIG, num_host_blocks, 2, torch.float32, CPU)
    for layer in device + host:
        layer.copy_(torch.randn(layer.shape, generator=generator))
    return device, host


@pytest.mark.parametrize("staged", [True, False])
def test_swap_out_and_in_of_one_step_reuse_the_freed_device_blocks(staged, monkeypatch):
    """staged False: a swap-out past the staging bound copies straight to the host, before the swap-ins."""
    if not staged:
        monkeypatch.setattr(kv_swap, "STAGING_MAX_BYTES", 0)
    device, host = _pools()
    device_before = [layer.clone() for layer in device]
    host_before = [layer.clone() for layer in host]
    swap_out = [BlockCopy(3, 0), BlockCopy(4, 1), BlockCopy(5, 2), BlockCopy(9, 7)]
    # the swap-in lands in blocks 4 and 9, which the swap-out frees in the same step
    swap_in = [BlockCopy(5, 9), BlockCopy(6, 4), BlockCopy(8, 10)]
    KVSwapper(device, host).apply(swap_out, swap_in)
    for layer in range(CONFIG.num_layers):
        for src, dst in swap_out:  # what the device block held before the step, not the swapped-in K/V
            assert torch.equal(host[layer][:, dst], device_before[layer][:, src])
        for src, dst in swap_in:
            assert torch.equal(device[layer][:, dst], host_before[layer][:, src])
        untouched_device = set(range(12)) - {dst for _, dst in swap_in}
        untouched_host = set(range(10)) - {dst for _, dst in swap_out}
        for block in untouched_device:
            assert torch.equal(device[layer][:, block], device_before[layer][:, block])
        for block in untouched_host:
            assert torch.equal(host[layer][:, block], host_before[layer][:, block])


@pytest.mark.parametrize("direction", ["out", "in"])
def test_one_direction_alone(direction):
    device, host = _pools(seed=1)
    device_before, host_before = [t.clone() for t in device], [t.clone() for t in host]
    pairs = [BlockCopy(7, 2), BlockCopy(8, 3), BlockCopy(1, 9)]
    swapper = KVSwapper(device, host)
    if direction == "out":
        swapper.apply(pairs, [])
        src, dst = device_before, host
    else:
        swapper.apply([], [BlockCopy(d, s) for s, d in pairs])
        src, dst = host_before, device
    for layer in range(CONFIG.num_layers):
        for a, b in pairs:
            s, d = (a, b) if direction == "out" else (b, a)
            assert torch.equal(dst[layer][:, d], src[layer][:, s])


def test_nothing_to_move_touches_nothing():
    device, host = _pools(seed=2)
    device_before, host_before = [t.clone() for t in device], [t.clone() for t in host]
    KVSwapper(device, host).apply([], [])
    assert all(torch.equal(a, b) for a, b in zip(device + host, device_before + host_before))


def test_layer_counts_must_match():
    device, host = _pools()
    with pytest.raises(ValueError, match="layers"):
        KVSwapper(device, host[:-1])


def test_a_host_block_swapped_in_from_and_out_to_in_one_step_is_refused():
    device, host = _pools()
    before = [t.clone() for t in device + host]
    with pytest.raises(ValueError, match=r"host blocks \[2\]"):
        KVSwapper(device, host).apply([BlockCopy(3, 2)], [BlockCopy(2, 5)])
    assert all(torch.equal(a, b) for a, b in zip(device + host, before))  # refused before anything moved
