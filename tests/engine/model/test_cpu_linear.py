"""Linears with packed weights (model/cpu_linear.py), through oneDNN and through the engine's own panel matmul
(model/panel_gemm.py, whose kernel tests are test_panel_gemm.py): the same results as nn.Linear and as
transformers, the tied lm_head still tied to what the embedding reads, and the backend chosen at start-up."""

import pytest
import torch
from torch import nn

from flotilla.engine.model import cpu_linear, load_model

from tests.support.kernels import kernels_cannot_build

from .helpers import KINDS, PagedDriver, hf_greedy, hf_logits, random_tokens

pytestmark = pytest.mark.unit
needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_works(), reason="this torch build has no working oneDNN linear")
PACKED_BACKENDS = [
    pytest.param("onednn", marks=needs_onednn),
    pytest.param("panel", marks=pytest.mark.skipif(kernels_cannot_build(), reason="no C compiler for the kernels")),
]
PACKED_LINEAR = {"onednn": cpu_linear.PackedLinear, "panel": cpu_linear.panel_gemm.PanelLinear}


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 65, 700])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96) * 3
    with torch.inference_mode():
        expected = linear(x)
        packed = cpu_linear.PackedLinear(linear)
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(x[:, None]), expected[:, None], rtol=1e-5, atol=1e-5)  # 3-D input


@needs_onednn
@pytest.mark.parametrize(("in_features", "out_features"), [(256, 1408), (576, 960), (768, 4608)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(in_features, out_features):
    """Bit for bit at 1 to 300 rows (MKL's F.linear is not: its first rows differ below 64 rows here), so a
    sequence's logits, seeded draws and a resumed stream's tokens do not depend on what shares its step."""
    torch.manual_seed(out_features)
    packed = cpu_linear.PackedLinear(nn.Linear(in_features, out_features, bias=False))
    x = torch.randn(300, in_features)
    with torch.inference_mode():
        everything = packed(x)
        for rows in (1, 2, 7, 63, 64, 65, 129):
            assert torch.equal(packed(x[:rows]), everything[:rows]), rows


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
def test_pack_linears_replaces_every_linear_and_keeps_the_embedding(checkpoint_factory, backend):
    ckpt = checkpoint_factory("qwen2_tied")
    model = load_model(ckpt.directory, torch.float32, torch.device("cpu"))
    embedding = model.model.embed_tokens.weight
    num_linears = sum(type(m) is nn.Linear for m in model.modules())
    assert cpu_linear.pack_linears(model, backend) == num_linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(type(m) is PACKED_LINEAR[backend] for m in model.modules()) == num_linears
    gated = [m for m in model.modules() if getattr(m, "applies_silu_mul", False)]
    assert len(gated) == (model.config.num_layers if backend == "panel" else 0)  # each MLP's gate/up
    assert model.model.embed_tokens.weight is embedding  # the lookup still reads the dense matrix
    assert all(p.layout == torch.strided for p in model.parameters())  # packed weights are not parameters


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_packed_model_matches_transformers(checkpoint_factory, kind, backend):
    ckpt = checkpoint_factory(kind)
    model = load_model(ckpt.directory, torch.float32, torch.device("cpu"))
    cpu_linear.pack_linears(model, backend)
    tokens = random_tokens(37, seed=1)
    torch.testing.assert_close(PagedDriver(model).all_logits("a", tokens), hf_logits(ckpt.hf, tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_tied"])
def test_packed_greedy_generation_equals_hf_generate(checkpoint_factory, kind, backend):
    ckpt = checkpoint_factory(kind)
    model = load_model(ckpt.directory, torch.float32, torch.device("cpu"))
    cpu_linear.pack_linears(model, backend)
    prompt = random_tokens(9, seed=30)
    driver = PagedDriver(model, block_size=4, seed=5)
    tokens = list(prompt)
    (logits,) = driver.step([("a", tokens, 0, len(tokens))])
    while len(tokens) < len(prompt) + 30:
        tokens.append(int(logits.argmax()))
        (logits,) = driver.step([("a", tokens, len(tokens) - 1, 1)])
    assert tokens == hf_greedy(ckpt.hf, prompt, 30)


@pytest.mark.skipif(kernels_cannot_build(), reason="no C compiler for the kernels")
def test_auto_packs_float32_on_a_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cpu_linear.resolve("auto", cpu, torch.float32) == "panel"
    assert cpu_linear.resolve("auto", cpu, torch.bfloat16) == "torch"
    assert cpu_linear.resolve("auto", cuda, torch.float32) == "torch"
    assert cpu_linear.resolve("torch", cpu, torch.float32) == "torch"
    assert cpu_linear.resolve("panel", cpu, torch.float32) == "panel"


@needs_onednn
def test_auto_falls_back_to_onednn_without_the_panel_kernel(monkeypatch):
    monkeypatch.setattr(cpu_linear.panel_gemm, "load", lambda: None)
    cpu = torch.device("cpu")
    assert cpu_linear.resolve("auto", cpu, torch.float32) == "onednn"
    assert cpu_linear.resolve("onednn", cpu, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="could not be built"):
        cpu_linear.resolve("panel", cpu, torch.float32)


@pytest.mark.parametrize(("name", "device", "dtype", "message"), [
    ("mkl", "cpu", torch.float32, "must be one of"),
    ("onednn", "cuda", torch.bfloat16, "packs float32 weights on a cpu"),
    ("onednn", "cpu", torch.float16, "packs float32 weights on a cpu"),
    ("panel", "cuda", torch.float32, "packs float32 weights on a cpu"),
])
def test_backends_that_cannot_apply_are_refused(name, device, dtype, message):
    with pytest.raises(ValueError, match=message):
        cpu_linear.resolve(name, torch.device(device), dtype)


def test_the_engine_config_refuses_an_unknown_backend():
    from flotilla.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_linear_backend"):
        EngineConfig(model_dir="unused", cpu_linear_backend="mkl").validate()
    EngineConfig(model_dir="unused", cpu_linear_backend="torch").validate()

