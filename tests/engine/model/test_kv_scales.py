"""An fp8 KV cache's scales (model/kv_scales.py): how a scale is picked, and attention over a scaled cache equals
attention over the same fp8 values widened and multiplied back in float32."""

import math

import pytest
import torch

from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention
from flotilla.engine.model.kv_cache import layer_shape
from flotilla.engine.model.kv_scales import HEADROOM, UNIT, KVScales, RangeRecorder, describe, needs_scales, scale_for

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("largest", [1e-4, 0.6, 1.0, 25.5, 112.0, 113.0, 1600.0, 3e5])
@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2])
def test_scale_is_the_power_of_two_that_leaves_headroom(largest, dtype):
    scale = scale_for(largest, dtype)
    fp8_max = torch.finfo(dtype).max
    assert math.log2(scale) == int(math.log2(scale))
    assert largest / scale <= fp8_max / HEADROOM  # fits, with room to spare
    assert largest / (scale / 2) > fp8_max / HEADROOM  # and the next power of two down would not


def test_scale_edge_cases():
    assert scale_for(0.0, E4M3) == 1.0  # a layer that never saw a non-zero value (nothing to scale)
    with pytest.raises(ValueError, match="largest K/V"):
        scale_for(float("nan"), E4M3)
    assert needs_scales(E4M3) and needs_scales(torch.float8_e5m2)
    assert not any(needs_scales(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16))


def test_recorder_keeps_each_layers_largest_and_describe_names_them():
    recorder = RangeRecorder(2)
    recorder.observe(0, torch.tensor([1.0, -30.0]), torch.tensor([0.5]))
    recorder.observe(0, torch.tensor([2.0]), torch.tensor([-0.75]))
    recorder.observe(1, torch.tensor([0.0]), torch.tensor([0.0]))
    assert recorder.largest == [[30.0, 0.75], [0.0, 0.0]]
    scales = recorder.scales(E4M3)
    assert scales == [KVScales(scale_for(30.0, E4M3), scale_for(0.75, E4M3)), UNIT]
    assert describe(torch.float32, [UNIT, UNIT]) == "float32"
    assert describe(E4M3, scales) == f"float8_e4m3fn scales {scales[0].k:g}/{scales[0].v:g} 1/1"


@pytest.mark.parametrize(("softcap", "scale"), [(None, None), (2.0, 0.3)])
def test_scaled_fp8_cache_equals_its_values_widened_and_scaled_back(softcap, scale):
    """A mixed step (decodes, a prefill, a chunk after cached tokens) on the torch path: K/V far outside e4m3's
    range are stored divided by their scales, and attention reads them back multiplied: the same as attending
    over (stored fp8 values * scale) in float32 with unit scales."""
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim, num_blocks = 4, 8, 2, 16, 32
    seqs = [SeqChunk(9, 1, [3, 7, 1]), SeqChunk(0, 6, [4, 9]), SeqChunk(5, 3, [12, 2])]
    num_tokens = sum(seq.num_tokens for seq in seqs)
    kv_scales = KVScales(2.0 ** 5, 2.0 ** -9)
    q = torch.randn(num_tokens, num_heads, head_dim) / 2.0 ** 8  # scores of the usual size
    k = torch.randn(num_tokens, num_kv_heads, head_dim) * 2.0 ** 8  # past 448: a unit scale would clip
    v = torch.randn(num_tokens, num_kv_heads, head_dim) * 2.0 ** -9  # below 2**-6: a unit scale would lose bits
    shape = layer_shape(num_blocks, block_size, num_kv_heads, head_dim)
    prefix = torch.randn(shape).to(E4M3)  # cached tokens from earlier steps, already stored
    meta = AttentionMetadata.build(seqs, block_size, CPU)

    scaled_cache = prefix.clone()
    actual = paged_attention(q, k, v, scaled_cache, meta, scale, None, softcap, kv_scales)

    widened = prefix.float()
    widened[0] *= kv_scales.k
    widened[1] *= kv_scales.v
    stored_k = (k / kv_scales.k).to(E4M3).float() * kv_scales.k
    stored_v = (v / kv_scales.v).to(E4M3).float() * kv_scales.v
    expected = paged_attention(q, stored_k, stored_v, widened, meta, scale, None, softcap)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)



def test_without_scales_such_keys_and_values_clip_and_underflow():
    """The same kind of K/V in a fresh prefill: scaled, the fp8 cache is off by its rounding; unscaled, far more."""
    torch.manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_dim = 12, 4, 2, 16
    q = torch.randn(num_tokens, num_heads, head_dim) / 2.0 ** 8  # scores of the usual size
    k = torch.randn(num_tokens, num_kv_heads, head_dim) * 2.0 ** 8
    v = torch.randn(num_tokens, num_kv_heads, head_dim) * 2.0 ** -9
    meta = AttentionMetadata.build([SeqChunk(0, num_tokens, [0, 1, 2])], 4, CPU)
    shape = layer_shape(3, 4, num_kv_heads, head_dim)

    def error(dtype, kv_scales):
        exact = paged_attention(q, k, v, torch.zeros(shape), meta)
        return (paged_attention(q, k, v, torch.zeros(shape, dtype=dtype), meta, kv_scales=kv_scales) - exact).abs().max() \
            / exact.abs().max()

    scaled = error(E4M3, KVScales(scale_for(k.abs().max().item(), E4M3), scale_for(v.abs().max().item(), E4M3)))
    assert scaled < 0.1  # e4m3 keeps 3 mantissa bits
    assert error(E4M3, UNIT) > 4 * scaled
