"""The Triton paged-attention kernel, run by Triton's CPU interpreter, agrees with the torch (gather + SDPA) path on
shuffled block tables, GQA, head dims that are not powers of two, block sizes that are not, mixed prefill/decode
steps (a prefill after a prefix hit among them), sliding windows and soft-caps.

The interpreter runs a kernel as numpy, a few hundred ms a launch: shapes stay small. It computes bfloat16 stores
wrongly (numpy has no bfloat16), so the narrow case here is float16; bf16 is the device check's
(loadtest/gpu_check.py).
"""

import os

import pytest
import torch

from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention
from flotilla.engine.model.kv_cache import layer_shape
from flotilla.engine.model.kv_scales import UNIT, KVScales

pytest.importorskip("triton")
# tests/conftest.py sets it before anything imports triton
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
CPU = torch.device("cpu")


def _step(seqs, block_size, num_heads, num_kv_heads, head_dim, num_blocks, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    num_tokens = sum(seq.num_tokens for seq in seqs)
    kv_cache = torch.randn(layer_shape(num_blocks, block_size, num_kv_heads, head_dim)).to(dtype)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    return kv_cache, q, k, v


def _both(seqs, block_size, kv_cache, q, k, v, window=None, softcap=None, scale=None, kv_scales=UNIT):
    """(torch path, Triton kernel) outputs and the caches each left behind."""
    results = []
    for use_triton in (False, True):
        meta = AttentionMetadata.build(seqs, block_size, CPU, sliding_window=window, use_triton=use_triton)
        assert (meta.query_start_loc is not None) == use_triton
        cache = kv_cache.clone()
        results.append((paged_attention(q, k, v, cache, meta, scale, window, softcap, kv_scales), cache))
    return results


def _tables(num_blocks, sizes, seed=0):
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for size in sizes:
        tables.append(perm[at:at + size])
        at += size
    return tables


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(8, 2, 16, 4), (4, 4, 24, 16), (12, 4, 40, 5), (6, 1, 8, 3)],
)
def test_mixed_step_matches_torch_path(num_heads, num_kv_heads, head_dim, block_size):
    """Decodes of different lengths, a fresh prefill and a chunk after a prefix hit in one step."""
    tables = _tables(64, [8, 1, 4, 6, 8], seed=num_heads)
    seqs = [
        SeqChunk(17, 1, tables[0]),
        SeqChunk(0, 1, tables[1]),
        SeqChunk(0, 9, tables[2]),  # prefill from the start
        SeqChunk(11, 5, tables[3]),  # chunked prefill / prefix hit: 11 tokens already cached
        SeqChunk(2 * block_size + 1, 1, tables[4]),
    ]
    kv_cache, q, k, v = _step(seqs, block_size, num_heads, num_kv_heads, head_dim, 64)
    (expected, expected_cache), (actual, actual_cache) = _both(seqs, block_size, kv_cache, q, k, v)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual_cache, expected_cache, atol=0, rtol=0)


@pytest.mark.parametrize(("window", "softcap", "scale"), [(5, None, None), (None, 2.0, None), (3, 1.5, 0.2)])
def test_window_softcap_and_scale_match_torch_path(window, softcap, scale):
    tables = _tables(64, [5, 3, 6], seed=3)
    seqs = [SeqChunk(18, 1, tables[0]), SeqChunk(4, 7, tables[1]), SeqChunk(0, 1, tables[2])]
    kv_cache, q, k, v = _step(seqs, 4, 8, 2, 16, 64, seed=1)
    q = q * 3  # large scores, so that the soft-cap bites
    (expected, _), (actual, _) = _both(seqs, 4, kv_cache, q, k, v, window, softcap, scale)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_long_prefill_spans_several_query_and_key_tiles():
    """More queries than one program's rows and more keys than one tile, behind a cached prefix."""
    tables = _tables(24, [20], seed=5)
    seqs = [SeqChunk(45, 30, tables[0])]
    kv_cache, q, k, v = _step(seqs, 4, 4, 2, 16, 24, seed=2)
    (expected, _), (actual, _) = _both(seqs, 4, kv_cache, q, k, v)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_float16_and_narrower_kv_cache():
    """fp16 q/K/V; and an fp8 cache read by both paths the same way (widened on load)."""
    tables = _tables(32, [4, 3], seed=7)
    seqs = [SeqChunk(9, 1, tables[0]), SeqChunk(3, 6, tables[1])]
    kv_cache, q, k, v = _step(seqs, 4, 4, 2, 16, 32, dtype=torch.float16)
    (expected, _), (actual, _) = _both(seqs, 4, kv_cache, q, k, v)
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=2e-3)
    kv_cache, q, k, v = _step(seqs, 4, 4, 2, 16, 32)
    (expected, expected_cache), (actual, actual_cache) = _both(seqs, 4, kv_cache.to(torch.float8_e4m3fn), q, k, v)
    assert actual_cache.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    exact, _ = _both(seqs, 4, kv_cache, q, k, v)[0]
    assert 0 < (actual - exact).abs().max() < 0.3  # fp8 rounding shows, within its precision


def test_scaled_fp8_cache_matches_torch_path():
    """An fp8 cache with K/V scales (model/kv_scales.py): the Triton kernel folds them in as the torch path does, and
    both store the same bytes."""
    tables = _tables(32, [4, 3], seed=8)
    seqs = [SeqChunk(9, 1, tables[0]), SeqChunk(3, 6, tables[1])]
    kv_cache, q, k, v = _step(seqs, 4, 4, 2, 16, 32, seed=3)
    scales = KVScales(2.0 ** 6, 2.0 ** -5)
    (expected, expected_cache), (actual, actual_cache) = _both(
        seqs, 4, kv_cache.to(torch.float8_e4m3fn), q * 2.0 ** -6, k * 2.0 ** 6, v * 2.0 ** -5, softcap=2.0,
        kv_scales=scales)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(actual_cache.view(torch.uint8), expected_cache.view(torch.uint8))


def test_empty_context_rows_come_out_zero():
    """A padded decode row (context length 0, as CUDA-graph padding makes) reads nothing and writes zeros."""
    from flotilla.engine.model import triton_attention

    kv_cache = torch.full(layer_shape(4, 4, 1, 16), float("nan"))
    q = torch.randn(2, 2, 16)
    out = triton_attention.paged_attention(q, kv_cache, torch.zeros(2, 1, dtype=torch.int64),
                                           torch.tensor([0, 1, 2]), torch.tensor([0, 0]), 1)
    torch.testing.assert_close(out, torch.zeros_like(q))


def _triton_decode(seqs, block_size, kv_cache, q, k, v, num_splits, window=None, softcap=None):
    """The Triton path on an all-decode step with its keys split `num_splits` ways (the torch path for reference)."""
    from flotilla.engine.model import triton_attention

    (expected, _), _ = _both(seqs, block_size, kv_cache, q, k, v, window, softcap)
    meta = AttentionMetadata.build(seqs, block_size, CPU, sliding_window=window, use_triton=True)
    cache = kv_cache.clone()
    paged_attention(q, k, v, cache, meta, None, window, softcap)  # writes this step's K/V
    actual = triton_attention.paged_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                                              1, None, window, softcap, max_context_len=meta.max_context_len,
                                              num_splits=num_splits)
    return expected, actual


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "num_splits"),
                         [(8, 2, 16, 3), (6, 1, 24, 4), (4, 4, 8, 2)])
def test_split_decode_matches_torch_path(num_heads, num_kv_heads, head_dim, num_splits):
    """Split-K decode: sequences of different lengths, the shortest with splits that hold none of its keys."""
    tables = _tables(64, [12, 1, 5, 9], seed=num_splits)
    seqs = [SeqChunk(45, 1, tables[0]), SeqChunk(2, 1, tables[1]), SeqChunk(17, 1, tables[2]),
            SeqChunk(33, 1, tables[3])]
    kv_cache, q, k, v = _step(seqs, 4, num_heads, num_kv_heads, head_dim, 64, seed=num_splits)
    expected, actual = _triton_decode(seqs, 4, kv_cache, q, k, v, num_splits)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_split_decode_with_window_and_softcap():
    tables = _tables(64, [12, 6], seed=9)
    seqs = [SeqChunk(46, 1, tables[0]), SeqChunk(21, 1, tables[1])]
    kv_cache, q, k, v = _step(seqs, 4, 8, 2, 16, 64, seed=4)
    expected, actual = _triton_decode(seqs, 4, kv_cache, q * 3, k, v, num_splits=3, window=20, softcap=2.0)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_decode_splits_fill_the_gpu_only_where_it_pays():
    from flotilla.engine.model.triton_attention import MAX_SPLITS, MIN_SPLIT_KEYS, decode_splits

    assert decode_splits(1, 8, 32_768, 132) == MAX_SPLITS  # batch 1, long context: as many as allowed
    assert decode_splits(1, 8, 4 * MIN_SPLIT_KEYS, 132) == 4  # no split shorter than MIN_SPLIT_KEYS
    assert decode_splits(1, 8, MIN_SPLIT_KEYS, 132) == 1
    assert decode_splits(64, 8, 32_768, 132) == 1  # 512 programs fill 132 multiprocessors already
    assert decode_splits(8, 8, 32_768, 132) == 5  # 64 programs: 5 splits make 320 >= 264
    assert decode_splits(1, 8, 0, 132) == 1  # context unknown


def test_forced_splits_cover_every_key_without_the_context_length():
    """Each sequence divides the keys it sees among the splits itself: no host-side length is needed to cover them."""
    tables = _tables(64, [12, 3], seed=11)
    seqs = [SeqChunk(45, 1, tables[0]), SeqChunk(9, 1, tables[1])]
    kv_cache, q, k, v = _step(seqs, 4, 8, 2, 16, 64, seed=5)
    from flotilla.engine.model import triton_attention

    (expected, _), _ = _both(seqs, 4, kv_cache, q, k, v)
    meta = AttentionMetadata.build(seqs, 4, CPU, use_triton=True)
    cache = kv_cache.clone()
    paged_attention(q, k, v, cache, meta)
    actual = triton_attention.paged_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                                              1, num_splits=5)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_gpu_tiles_shrink_as_a_row_of_q_widens(monkeypatch):
    """On a GPU (not the interpreter) 64 x 64 tiles up to 128 16-bit values a row, halved per doubling past it, fp32
    counting four times; decode keeps its 16 rows. loadtest/kernel_compile_check.py shows why: larger tiles spill."""
    from flotilla.engine.model import triton_attention

    assert triton_attention.tile_sizes(128, torch.bfloat16, decode=False) == (16, 16)  # the interpreter's
    monkeypatch.setattr(triton_attention, "_INTERPRETED", False)
    monkeypatch.setattr(triton_attention, "DECODE_ROWS", 16)
    assert triton_attention.tile_sizes(128, torch.bfloat16, decode=False) == (64, 64)
    assert triton_attention.tile_sizes(96, torch.float16, decode=False) == (64, 64)  # padded to 128
    assert triton_attention.tile_sizes(256, torch.bfloat16, decode=False) == (32, 32)
    assert triton_attention.tile_sizes(256, torch.bfloat16, decode=True) == (16, 32)
    assert triton_attention.tile_sizes(64, torch.float32, decode=False) == (32, 32)
    assert triton_attention.tile_sizes(256, torch.float32, decode=False) == (16, 16)


def test_warm_up_launches_every_kind_of_step_for_each_kind_of_layer():
    """Three launches (decode, split decode, prefill) per (window, soft-cap) the layers use, on the layer cache
    itself; which variants they compile is loadtest/kernel_compile_check.py's (it needs the compiler)."""
    from flotilla.engine.model import triton_attention

    kv_cache = torch.zeros(layer_shape(3, 16, 2, 24))
    before = kv_cache.clone()
    assert triton_attention.warm_up(kv_cache, 4, torch.float32, [(None, None), (8, 30.0), (None, None)]) == 6
    assert torch.equal(kv_cache, before)  # reads the cache, writes nothing of it
