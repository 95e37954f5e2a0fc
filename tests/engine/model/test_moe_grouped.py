"""The MoE experts' two ways (moe.py): torch._grouped_mm with the groups' ends as a tensor, which a CPU and CUDA bf16
run, and the Python loop over the experts hit. Each against the other and against transformers through a paged
Qwen3-MoE; the grouped way reads nothing back to the host (the loop reads each layer's expert counts), which on CUDA
keeps a step free of host syncs."""

import logging

import pytest
import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.model import load_model
from flotilla.engine.model.config import MoEConfig
from flotilla.engine.model.moe import Experts, grouped_mm_fits, settle_experts_way

from .helpers import PagedDriver, add_tokenizer, hf_chunked_logits, random_tokens


def _experts(seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    moe = MoEConfig(num_experts=6, num_experts_per_tok=2, intermediate_size=48, norm_topk_prob=True, sparse_layers=(0,))
    experts = Experts(32, moe)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.25)
    return experts


def _routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, 32], and each token's two experts among the first four (experts 4 and 5 get no token) with weights."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 32, generator=generator)
    probs = torch.rand(num_tokens, 4, generator=generator).softmax(-1)
    weights, expert_ids = probs.topk(2, dim=-1)
    return x, expert_ids, weights


def _token_by_token(experts: Experts, x, expert_ids, weights) -> torch.Tensor:
    rows = []
    for token in range(x.shape[0]):
        row = torch.zeros(x.shape[1])
        for expert, weight in zip(expert_ids[token].tolist(), weights[token]):
            gate, up = (experts.gate_up_proj[expert] @ x[token]).chunk(2)
            row += weight * (experts.down_proj[expert] @ (torch.nn.functional.silu(gate) * up))
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_grouped_equals_the_loop_and_each_token_alone(num_tokens):
    experts = _experts()
    x, expert_ids, weights = _routing(num_tokens, seed=num_tokens)
    with torch.no_grad():
        grouped = experts._grouped(x, expert_ids, weights)
        loop = experts._loop(x, expert_ids, weights)
        alone = _token_by_token(experts, x, expert_ids, weights)
    assert torch.equal(grouped, loop)  # on a CPU PyTorch's grouped call runs the same matmuls in the same order
    torch.testing.assert_close(grouped, alone, atol=1e-4, rtol=1e-4)


def test_a_cpu_runs_grouped_unless_rows_are_misaligned():
    cpu = torch.device("cpu")
    assert grouped_mm_fits(cpu, torch.float32, 32, 48)
    assert not grouped_mm_fits(cpu, torch.float32, 30, 48)  # 120-byte rows: the grouped call refuses them
    assert not grouped_mm_fits(cpu, torch.float32, 32, 50)
    assert not grouped_mm_fits(cpu, torch.bfloat16, 32, 44)  # 88 bytes


class HostRead(Exception):
    pass


def test_grouped_reads_nothing_back_to_the_host(monkeypatch):
    """On CUDA each of these waits for the device; the grouped way must call none of them (the loop does)."""
    experts = _experts()
    x, expert_ids, weights = _routing(9, seed=1)

    def host_read(*args, **kwargs):
        raise HostRead
    for name in ("tolist", "item", "__bool__", "__int__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    monkeypatch.setattr(torch, "bincount", host_read)  # sizes its output by the ids' max, read back on CUDA
    with torch.no_grad():
        experts._grouped(x, expert_ids, weights)
        with pytest.raises(HostRead):
            experts._loop(x, expert_ids, weights)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_paged_qwen3_moe_matches_hf_either_way(checkpoint_factory, grouped):
    """Chunked prefill then decode through the paged cache with every MoE layer run one way, against transformers."""
    ckpt = checkpoint_factory("qwen3_moe")
    experts = [module for module in ckpt.model.modules() if isinstance(module, Experts)]
    assert experts
    tokens = random_tokens(24, seed=4)
    sizes = [7, 9] + [1] * 8
    try:
        for module in experts:
            module.grouped = grouped
        driver = PagedDriver(ckpt.model, block_size=4, seed=2)
        start = 0
        for size, reference in zip(sizes, hf_chunked_logits(ckpt.hf, tokens, sizes)):
            (logits,) = driver.step([("a", tokens, start, size)])
            start += size
            torch.testing.assert_close(logits, reference[-1], atol=1e-4, rtol=0)
    finally:
        for module in experts:
            module.grouped = None


def _fresh_moe_model(checkpoint_factory):
    return load_model(checkpoint_factory("qwen3_moe").directory, torch.float32, torch.device("cpu"))


def test_start_up_settles_every_layer_grouped_on_a_cpu(checkpoint_factory):
    ckpt = checkpoint_factory("qwen3_moe")
    add_tokenizer(ckpt.directory)
    engine = LLMEngine(EngineConfig(model_dir=str(ckpt.directory), num_kv_blocks=16, block_size=4))
    layers = [module for module in engine.runner.model.modules() if isinstance(module, Experts)]
    assert engine.moe_grouped is True and layers and all(layer.grouped is True for layer in layers)


@pytest.mark.parametrize("failure", ["raises", "differs"])
def test_a_grouped_call_that_fails_its_probe_leaves_every_layer_on_the_loop(checkpoint_factory, monkeypatch, caplog,
                                                                            failure):
    """The grouped call has never run on a GPU: if it is refused or wrong where it should fit, the model still serves
    through the loop, and the log says why."""
    model = _fresh_moe_model(checkpoint_factory)
    if failure == "raises":
        def refused(*args, **kwargs):
            raise RuntimeError("grouped gemm is not supported here")
        monkeypatch.setattr(torch, "_grouped_mm", refused)
    else:
        grouped = Experts._grouped
        monkeypatch.setattr(Experts, "_grouped", lambda self, *args: grouped(self, *args) * 1.5)
    with caplog.at_level(logging.WARNING, logger="flotilla.engine.model.moe"):
        assert settle_experts_way(model) is False
    layers = [module for module in model.modules() if isinstance(module, Experts)]
    assert layers and all(layer.grouped is False for layer in layers)
    assert "every layer runs the loop" in caplog.text
    assert ("failed" if failure == "raises" else "differs") in caplog.text


def test_a_model_without_experts_settles_nothing(checkpoint_factory):
    assert settle_experts_way(load_model(checkpoint_factory("qwen3").directory, torch.float32,
                                         torch.device("cpu"))) is False
