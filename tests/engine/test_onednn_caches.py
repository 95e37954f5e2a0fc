"""With oneDNN's primitive caches bounded, a packed linear called at 100 row counts keeps (almost) nothing per
shape; with oneDNN's defaults (1,024 shapes each) the process grows with every new row count. Each case runs in
its own interpreter: the caches read their capacity once, at the process's first oneDNN primitive."""

import os
import subprocess
import sys

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.model import cpu_linear

pytestmark = pytest.mark.integration  # each case starts an interpreter

GROWTH_OVER_100_SHAPES = """
import sys, torch
from torch import nn
from flotilla.engine.model import cpu_linear
if sys.argv[1] != "default":
    cpu_linear.bound_primitive_caches(int(sys.argv[1]))
torch.manual_seed(0)
linear = cpu_linear.PackedLinear(nn.Linear(256, 2048, bias=False))
inputs = [torch.randn(rows, 256) for rows in range(300, 400)]
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
linear(inputs[0])
before = resident_mib()
for x in inputs:
    linear(x)
print(resident_mib() - before)
"""


def _growth_mib(capacity: str) -> float:
    done = subprocess.run([sys.executable, "-c", GROWTH_OVER_100_SHAPES, capacity],
                          capture_output=True, text=True, timeout=120, check=True)
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not cpu_linear.onednn_works(),
                    reason="needs /proc and torch's oneDNN linear")
def test_bounded_caches_stop_the_growth_per_row_count():
    unbounded = _growth_mib("default")
    if unbounded < 20:  # measured ~55 MiB on an AVX-512 EPYC; elsewhere oneDNN may keep no buffer per shape
        pytest.skip(f"this CPU's oneDNN grew only {unbounded:.1f} MiB over 100 shapes with its default caches")
    bounded = _growth_mib("8")
    assert bounded < unbounded / 4, (bounded, unbounded)


def test_the_bound_leaves_the_environment_as_it_was_and_is_on_by_default(monkeypatch):
    monkeypatch.setenv(cpu_linear.PRIMITIVE_CACHE_VARIABLES[0], "1024")
    monkeypatch.delenv(cpu_linear.PRIMITIVE_CACHE_VARIABLES[1], raising=False)
    cpu_linear.bound_primitive_caches(16)
    assert os.environ[cpu_linear.PRIMITIVE_CACHE_VARIABLES[0]] == "1024"
    assert cpu_linear.PRIMITIVE_CACHE_VARIABLES[1] not in os.environ
    assert EngineConfig(model_dir="unused").onednn_primitive_cache_capacity == 16
    with pytest.raises(ValueError, match="onednn_primitive_cache_capacity"):
        EngineConfig(model_dir="unused", onednn_primitive_cache_capacity=0).validate()
