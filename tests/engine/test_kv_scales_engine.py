"""The engine calibrates an fp8 cache's scales at start-up (kv_calibration.py). The proof that they work: a copy
of the model whose keys and values are 2**10 times larger (k_proj, v_proj times 2**10; q_proj, o_proj divided by
it, so the same function in exact arithmetic) runs bit for bit as the original does, though its keys pass e4m3's
±448. With unit scales it clips them and its log-probabilities move."""

import dataclasses

import pytest

from flotilla.engine.engine import LLMEngine
from flotilla.engine.model.kv_scales import UNIT
from loadtest.bench_kv_dtype import rescaled_copy
from loadtest.common.greedy_compare import greedy_with_logprobs

from tests.support.engines import engine_config

pytestmark = pytest.mark.unit
FACTOR = 2.0 ** 10
PROMPTS = [[5, 6, 7, 8], list(range(40, 90))]


@pytest.fixture(scope="module")
def rescaled_checkpoint(tiny_checkpoint, tmp_path_factory):
    return rescaled_copy(tiny_checkpoint, FACTOR, tmp_path_factory.mktemp("rescaled"))


def _run(checkpoint, kv_cache_scales="calibrate"):
    """(engine, [(token ids, their log-probabilities)] per prompt), greedy."""
    config = dataclasses.replace(engine_config(checkpoint), kv_cache_dtype="float8_e4m3fn",
                                 kv_cache_scales=kv_cache_scales)
    engine = LLMEngine(config)
    token_ids, logprobs = greedy_with_logprobs(engine, PROMPTS, 10, ignore_eos=True)
    return engine, list(zip(token_ids, logprobs))


def test_calibrated_scales_make_the_cache_blind_to_the_kv_range(tiny_checkpoint, rescaled_checkpoint):
    engine, original = _run(tiny_checkpoint)
    rescaled_engine, rescaled = _run(rescaled_checkpoint)
    assert rescaled == original
    for scales, rescaled_scales in zip(engine.kv_scales, rescaled_engine.kv_scales):
        assert (rescaled_scales.k, rescaled_scales.v) == (scales.k * FACTOR, scales.v * FACTOR)
    assert engine.kv_cache_format.startswith("float8_e4m3fn scales ")
    assert engine.kv_cache_format != rescaled_engine.kv_cache_format  # these two must not swap blocks

    attentions = [layer.self_attn for layer in rescaled_engine.runner.model.model.layers]
    assert [attention.kv_scales for attention in attentions] == rescaled_engine.kv_scales
    assert all(attention.range_recorder is None for attention in attentions)  # the calibration pass is over
    assert max(scales.k for scales in rescaled_engine.kv_scales) > 1  # the rescaled keys needed one above 1

    unit_engine, clipped = _run(rescaled_checkpoint, "unit")
    assert unit_engine.kv_scales == [UNIT] * len(unit_engine.kv_scales)
    assert unit_engine.kv_cache_format == "float8_e4m3fn"
    worst = max(abs(a - b) for (_, ours), (_, theirs) in zip(clipped, original) for a, b in zip(ours, theirs))
    assert worst > 0.05 or [ids for ids, _ in clipped] != [ids for ids, _ in original]


def test_caches_of_the_models_dtype_are_not_scaled(tiny_checkpoint):
    engine = LLMEngine(engine_config(tiny_checkpoint))
    assert engine.kv_scales == [UNIT] * len(engine.kv_scales)
    assert engine.kv_cache_format == "float32"
    assert all(layer.self_attn.kv_scales == UNIT for layer in engine.runner.model.model.layers)


def test_an_unknown_scales_setting_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="kv_cache_scales"):
        LLMEngine(dataclasses.replace(engine_config(tiny_checkpoint), kv_cache_scales="dynamic"))
