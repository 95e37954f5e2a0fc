"""CUDA graphs for MoE decode steps: captured only where every MoE layer runs grouped (fixed shapes, routing read on
the device); the loop follows each step's routing and reads counts back, so a model on it decodes eagerly. On a
CPU, a Qwen3-MoE engine on the Triton backend (Triton's interpreter) decodes through the graphs' static buffers,
padding rows routed to experts like any token, greedy token for token equal to the default CPU engine. The capture
itself needs CUDA (loadtest/common/gpu_moe_graphs.py in the device check)."""

import os

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.cuda_graphs import graphs_apply
from flotilla.engine.engine import LLMEngine
from flotilla.engine.model import load_model
from flotilla.engine.model.moe import expert_layers, settle_experts_way
from flotilla.engine.sampling_params import SamplingParams

from .helpers import add_tokenizer


def test_graphs_apply_to_a_moe_model_only_once_every_layer_is_settled_grouped(checkpoint_factory):
    import torch

    model = load_model(checkpoint_factory("qwen3_moe").directory, torch.float32, torch.device("cpu"))
    layers = expert_layers(model)
    assert layers and not graphs_apply(model)  # unsettled: each call would pick its own way
    assert settle_experts_way(model) is True and graphs_apply(model)  # grouped on a CPU
    layers[-1].grouped = False
    assert not graphs_apply(model)
    for layer in layers:
        layer.grouped = False  # the loop, as after a failed start-up probe
    assert not graphs_apply(model)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
def test_triton_moe_engine_with_decode_graph_buffers_matches_cpu_engine(checkpoint_factory, monkeypatch):
    """Prompts chunked over mixed steps, then decode steps through the static buffers, padded to a captured size
    (a padding row's token 0 goes through the router and two experts; its output is dropped), against the CPU
    engine on the torch path."""
    pytest.importorskip("triton")
    ckpt = checkpoint_factory("qwen3_moe")
    add_tokenizer(ckpt.directory)
    prompts = [[5 + i, 17, 3 * i + 1] * (i + 1) for i in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    config = dict(model_dir=str(ckpt.directory), device="cpu", num_kv_blocks=32, block_size=4, max_model_len=64,
                  max_num_batched_tokens=8)
    expected = [r.token_ids for r in LLMEngine(EngineConfig(**config)).generate(prompts, params)]
    sizes_asked = []

    def graph_sizes(self, model):  # what a CUDA engine captures, at two sizes
        sizes_asked.append(graphs_apply(model))
        return [1, 4]

    monkeypatch.setattr(LLMEngine, "_graph_sizes", graph_sizes)
    engine = LLMEngine(EngineConfig(**config, attention_backend="triton"))
    assert sizes_asked == [True] and engine.moe_grouped
    replays = []
    run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda rows, held=None: replays.append(len(rows)) or run(rows, held)
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert replays and any(size not in (1, 4) for size in replays)  # at least one step was padded
