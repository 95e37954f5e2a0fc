"""The Triton attention kernels compiled for real GPUs (sm_90: H100/H200; sm_80: A100) on this CPU: every launch
the engine makes for the device check's shapes and a head dim of 256, in bf16 (with a bf16 or fp8 cache) and fp32,
builds to a cubin, fits the architecture's shared memory, loads K/V as 16-byte vectors, multiplies 16-bit tiles on
the tensor cores and fp32 ones in IEEE precision, compiles once whatever a step's block-table width or split count,
is compiled by the engine's start-up warm-up, and on sm_90 spills no register. The interpreter tests
(tests/engine/model/test_triton_attention.py) check what the kernels compute; this checks that a GPU would take
them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loadtest.common import triton_aot

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "loadtest" / "kernel_compile_check.py"
SHAPES = ("llama-1b", "llama-8b", "gemma2-9b")


def _compile_env(tmp_path: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from an earlier run's cache
    return env


def test_every_launch_builds_for_hopper_and_ampere(tmp_path):
    # fp16 is left to the full check (`make kernel-check`): it compiles as bf16 does, and the suite's time is short
    shape_args = [arg for name in SHAPES for arg in ("--shape", name)]
    run = subprocess.run([sys.executable, str(CHECK), "--quiet", "--dtype", "bfloat16", "--dtype", "float32",
                          *shape_args], env=_compile_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["problems"] == []
    launches = report["launches"]
    # sm_90: 3 shapes x 4 dtype pairs (bf16 with a bf16 and two fp8 caches, fp32) x (decode, split decode's two
    # kernels, prefill); sm_80 has no fp8 cache
    assert len([launch for launch in launches if launch["arch"] == 90]) == 3 * 4 * 4
    assert len([launch for launch in launches if launch["arch"] == 80]) == 3 * 2 * 4
    assert [launch for launch in report["spilled"] if launch["arch"] == 90] == []
    for launch in launches:
        assert launch["registers"] > 0 and launch["shared_bytes"] <= triton_aot.SHARED_MEMORY_LIMIT[launch["arch"]]
        # one compile whatever the step's block-table width or split count, and the start-up warm-up made it
        assert launch["variants"] == 1 and launch["compiled_while_serving"] == 0, launch
        if launch["kernel"] != "_paged_attention_kernel":
            continue
        # K/V tiles come in as 16-byte vectors (the launch's strides and pointers specialised as divisible by 16)
        assert launch["async_copy_bytes"].get("16", 0) > 0, launch
        # 16-bit q.K and p.V on the tensor cores; fp32 in IEEE precision as FMAs, never TF32 (transformers' fp32)
        assert (launch["tensor_core_instructions"] > 0) == (launch["dtype"] != "float32"), launch


def test_it_refuses_to_run_under_the_interpreter(tmp_path):
    env = {**_compile_env(tmp_path), "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(CHECK), "--arch", "90"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "unset TRITON_INTERPRET" in run.stderr


def test_refusals_and_spills_are_told_apart():
    fine = {"kernel": "k", "shared_bytes": 1024, "shared_fits": True, "spill_store_bytes": 0, "spill_load_bytes": 0}
    broken = {"kernel": "k", "error": "CompilationError: ..."}
    too_big = {**fine, "shared_bytes": 300_000, "shared_fits": False}
    spilling = {**fine, "spill_store_bytes": 8, "spill_load_bytes": 4}
    found = triton_aot.problems([fine, broken, too_big, spilling])
    assert [launch["problem"] for launch in found] == ["compile error", "shared memory past the architecture's limit"]
    assert triton_aot.spilled([fine, broken, too_big, spilling]) == [spilling]


@pytest.mark.parametrize("phase", triton_aot.PHASES)
def test_a_step_is_recorded_as_the_launcher_makes_it(phase):
    """The recorded launches carry what the engine passes: the split step's two kernels (split as on an H100),
    the engine's metadata."""
    launches = triton_aot.step_launches(triton_aot.SHAPES[1], torch.bfloat16, torch.bfloat16, phase)
    names = [launch.kernel.fn.__name__ for launch in launches]
    assert names == (["_paged_attention_kernel", "_combine_splits_kernel"] if phase == "decode-split"
                     else ["_paged_attention_kernel"])
    kwargs = launches[0].kwargs
    assert kwargs["SPLIT"] == (phase == "decode-split") and (kwargs["num_splits"] > 1) == kwargs["SPLIT"]
    assert kwargs["HEAD_DIM"] == 128 and kwargs["GROUP"] == 4
    block_tables = launches[0].args[4]  # the engine's own metadata: int64 tables, 4 sequences
    context_len = triton_aot.CONTEXT_LENS[phase][-1]
    assert block_tables.dtype == torch.int64 and block_tables.shape == (4, -(-context_len // 16))
