"""The engine packs its linears on a CPU (model/cpu_linear.py): for its own panel matmul by default, for oneDNN
when told to, and keeps nn.Linear when told to; all three generate the same greedy tokens."""

import dataclasses

import pytest
from torch import nn

from flotilla.engine.engine import LLMEngine
from flotilla.engine.model import cpu_linear
from flotilla.engine.sampling_params import SamplingParams

from tests.support.engines import engine_config
from tests.support.kernels import kernels_cannot_build

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not cpu_linear.onednn_works() or kernels_cannot_build(),
                       reason="this torch build has no working oneDNN linear, or no C compiler for the kernels"),
]
MODULE = {"auto": cpu_linear.panel_gemm.PanelLinear, "panel": cpu_linear.panel_gemm.PanelLinear,
          "onednn": cpu_linear.PackedLinear, "torch": nn.Linear}


def test_each_backend_packs_its_linears_and_all_generate_the_same(tiny_checkpoint):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    generated = {}
    for backend, module in MODULE.items():
        engine = LLMEngine(dataclasses.replace(engine_config(tiny_checkpoint), cpu_linear_backend=backend))
        assert {type(m) for m in engine.runner.model.modules()} & set(MODULE.values()) == {module}, backend
        generated[backend] = engine.generate([[5, 6, 7, 8], list(range(40, 90))], [params, params])
    tokens = {backend: [output.token_ids for output in outputs] for backend, outputs in generated.items()}
    assert all(len(ids) == 12 for ids in tokens["auto"])
    assert tokens["panel"] == tokens["onednn"] == tokens["torch"] == tokens["auto"]
