"""The engine packs its linears for oneDNN on a CPU by default (model/cpu_linear.py), and keeps nn.Linear when
told to; both generate."""

import dataclasses

import pytest
from torch import nn

from flotilla.engine.engine import LLMEngine
from flotilla.engine.model import cpu_linear
from flotilla.engine.sampling_params import SamplingParams

from tests.support.engines import engine_config

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not cpu_linear.onednn_works(), reason="this torch build has no working oneDNN linear"),
]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_the_engine_packs_its_linears_unless_told_not_to(tiny_checkpoint, backend):
    engine = LLMEngine(dataclasses.replace(engine_config(tiny_checkpoint), cpu_linear_backend=backend))
    linears = {type(m) for m in engine.runner.model.modules()} & {nn.Linear, cpu_linear.PackedLinear}
    assert linears == ({cpu_linear.PackedLinear} if backend == "auto" else {nn.Linear})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[5, 6, 7, 8]], [params])[0].token_ids) == 12
