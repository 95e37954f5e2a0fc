"""An fp8 cache takes a checkpoint's own K/V scales (llm-compressor's self_attn.k_scale / v_scale, the older
k_proj.output_scale / v_proj.output_scale or one kv_scale) when it has them: kv_cache_scales "auto" (the default)
or "checkpoint". The proof that they are the ones used: a checkpoint carrying the scales calibration would give,
on the model whose keys and values are 2**10 times larger, runs bit for bit as the calibrated engine does, and one
carrying other scales runs with exactly those."""

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flotilla.engine.engine import LLMEngine
from flotilla.engine.model.kv_scales import KVScales, checkpoint_scales
from flotilla.engine.model.loader import check_checkpoint
from loadtest.bench_kv_dtype import rescaled_copy
from loadtest.common.greedy_compare import greedy_with_logprobs

from tests.support.engines import engine_config

pytestmark = pytest.mark.unit
PROMPTS = [[5, 6, 7, 8], list(range(40, 90))]
# Each way a checkpoint names a layer's scales, by layer (cycled).
NAMINGS = ({"self_attn.k_scale": "k", "self_attn.v_scale": "v"},
           {"self_attn.k_proj.output_scale": "k", "self_attn.v_proj.output_scale": "v"})


@pytest.fixture(scope="module")
def rescaled_checkpoint(tiny_checkpoint, tmp_path_factory):
    return rescaled_copy(tiny_checkpoint, 2.0 ** 10, tmp_path_factory.mktemp("rescaled"))


def with_scales(model_dir, out, scales_by_name: dict[str, torch.Tensor]):
    """A copy of the checkpoint with these extra tensors in its (one) safetensors file."""
    shutil.copytree(model_dir, out)
    [path] = out.glob("*.safetensors")
    tensors = load_file(path)
    save_file({**tensors, **scales_by_name}, path, metadata={"format": "pt"})
    return out


def scale_tensors(scales: list[KVScales]) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer, layer_scales in enumerate(scales):
        for suffix, kind in NAMINGS[layer % len(NAMINGS)].items():
            tensors[f"model.layers.{layer}.{suffix}"] = torch.tensor(getattr(layer_scales, kind))
    return tensors


def _run(checkpoint, kv_cache_scales="auto"):
    config = dataclasses.replace(engine_config(checkpoint), kv_cache_dtype="float8_e4m3fn",
                                 kv_cache_scales=kv_cache_scales)
    engine = LLMEngine(config)
    return engine, greedy_with_logprobs(engine, PROMPTS, 10, ignore_eos=True)


def test_a_checkpoints_scales_are_the_ones_the_cache_uses(rescaled_checkpoint, tmp_path):
    calibrated_engine, calibrated = _run(rescaled_checkpoint, "calibrate")
    assert max(scales.k for scales in calibrated_engine.kv_scales) > 1  # unit scales would clip these keys
    stored = with_scales(rescaled_checkpoint, tmp_path / "stored", scale_tensors(calibrated_engine.kv_scales))
    check_checkpoint(stored)  # the scale tensors are known names, not tensors it cannot place
    for mode in ("auto", "checkpoint"):
        engine, run = _run(stored, mode)
        assert engine.kv_scales == calibrated_engine.kv_scales and run == calibrated
        assert engine.kv_cache_format == calibrated_engine.kv_cache_format

    others = [KVScales(0.375 * (layer + 1), 1.875) for layer in range(len(calibrated_engine.kv_scales))]
    other = with_scales(rescaled_checkpoint, tmp_path / "other", scale_tensors(others))
    engine, run = _run(other)
    assert engine.kv_scales == others  # taken as they are (exact in float32): not powers of two, not re-measured
    assert [layer.self_attn.kv_scales for layer in engine.runner.model.model.layers] == others
    assert engine.kv_cache_format.startswith("float8_e4m3fn scales 0.375/1.875 0.75/1.875")
    assert run != calibrated
    recalibrated, _ = _run(other, "calibrate")  # calibrate ignores the checkpoint's
    assert recalibrated.kv_scales == calibrated_engine.kv_scales


def test_without_scale_tensors_auto_calibrates_and_checkpoint_refuses(tiny_checkpoint):
    engine, _ = _run(tiny_checkpoint)
    calibrated, _ = _run(tiny_checkpoint, "calibrate")
    assert engine.kv_scales == calibrated.kv_scales
    with pytest.raises(ValueError, match="has no KV-cache scale tensors.*'calibrate'"):
        _run(tiny_checkpoint, "checkpoint")


def test_a_16_bit_cache_ignores_the_checkpoints_scales(tiny_checkpoint, tmp_path):
    stored = with_scales(tiny_checkpoint, tmp_path / "stored", scale_tensors([KVScales(0.5, 0.25)] * 2))
    engine = LLMEngine(engine_config(stored))
    assert engine.kv_cache_format == "float32"


def test_scale_tensors_are_read_per_layer_and_checked():
    two_layers = {"model.layers.0.self_attn.kv_scale": torch.tensor([0.5]),  # AutoFP8: one for K and V
                  "model.layers.1.self_attn.k_scale": torch.tensor([0.25, 2.0, 0.5]),  # one per KV head
                  "model.layers.1.self_attn.v_scale": torch.tensor(3.0),
                  "model.layers.1.self_attn.q_scale": torch.tensor(9.0)}  # an fp8 attention's: not the cache's
    assert checkpoint_scales(two_layers, 2) == [KVScales(0.5, 0.5), KVScales(2.0, 3.0)]
    assert checkpoint_scales({"model.layers.0.self_attn.q_scale": torch.tensor(1.0)}, 1) is None
    assert checkpoint_scales({}, 2) is None
    with pytest.raises(ValueError, match=r"lack layer 1 v_scale \(3 of 4 given\)"):
        checkpoint_scales({k: v for k, v in two_layers.items() if k != "model.layers.1.self_attn.v_scale"}, 2)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale is .*positive finite"):
            checkpoint_scales({**two_layers, "model.layers.1.self_attn.k_scale": torch.tensor(bad)}, 2)
