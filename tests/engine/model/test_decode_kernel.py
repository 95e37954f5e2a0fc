"""The CPU decode kernel reads K/V through block tables and must agree with the SDPA path."""

import pytest
import torch

from flotilla.engine.model import decode_kernel
from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention
from flotilla.engine.model.kv_cache import layer_shape, token_major
from tests.support.kernels import needs_kernels

pytestmark = needs_kernels


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 4, 32), (4, 4, 16), (12, 2, 64), (8, 1, 8)])
def test_kernel_matches_sdpa_path(num_heads, num_kv_heads, head_dim):
    torch.manual_seed(0)
    block_size, num_blocks = 4, 64
    kv_cache = torch.randn(layer_shape(num_blocks, block_size, num_kv_heads, head_dim))
    # three decode sequences with shuffled, non-contiguous tables and different lengths, one prefill chunk
    perm = torch.randperm(num_blocks).tolist()
    seqs = [SeqChunk(9, 1, perm[0:3]), SeqChunk(0, 1, perm[3:4]), SeqChunk(30, 1, perm[4:12]), SeqChunk(2, 5, perm[12:14])]
    q = torch.randn(8, num_heads, head_dim)
    k = torch.randn(8, num_kv_heads, head_dim)
    v = torch.randn(8, num_kv_heads, head_dim)
    results = []
    for use_kernel in (False, True):
        meta = AttentionMetadata.build(seqs, block_size, torch.device("cpu"), use_decode_kernel=use_kernel)
        assert (meta.decode_rows is not None) == use_kernel
        results.append(paged_attention(q, k, v, kv_cache.clone(), meta))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap", "scale"),
                         [(5, None, None), (None, 2.0, None), (3, 1.5, 0.2), (64, None, 0.3)])
def test_kernel_window_and_softcap_match_the_torch_path(window, softcap, scale):
    """Sliding window (keys older than `window` are never read), tanh soft-cap and scale as the SDPA/math path."""
    torch.manual_seed(1)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 4, 64, 8, 2, 16
    kv_cache = torch.randn(layer_shape(num_blocks, block_size, num_kv_heads, head_dim))
    perm = torch.randperm(num_blocks).tolist()
    seqs = [SeqChunk(9, 1, perm[0:3]), SeqChunk(0, 1, perm[3:4]), SeqChunk(30, 1, perm[4:12]),
            SeqChunk(4, 1, perm[12:14])]
    q = torch.randn(4, num_heads, head_dim) * 3  # large scores, so that the soft-cap bites
    k = torch.randn(4, num_kv_heads, head_dim)
    v = torch.randn(4, num_kv_heads, head_dim)
    results = []
    for use_kernel in (False, True):
        meta = AttentionMetadata.build(seqs, block_size, torch.device("cpu"), use_decode_kernel=use_kernel,
                                       sliding_window=window)
        results.append(paged_attention(q, k, v, kv_cache.clone(), meta, scale, window, softcap))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    plain = AttentionMetadata.build(seqs, block_size, torch.device("cpu"), use_decode_kernel=True)
    assert not torch.allclose(paged_attention(q, k, v, kv_cache.clone(), plain), results[0], atol=1e-3)


def test_kernel_window_never_reads_older_keys():
    kv_cache = torch.zeros(layer_shape(4, 2, 1, 4))  # blocks of 2 tokens
    kv_cache[1, 3] = 1.0  # V of context tokens 2 and 3 (block 3)
    kv_cache[:, 2] = float("nan")  # tokens 0 and 1, outside a window of 2: never read
    out = decode_kernel.paged_decode_attention(torch.ones(1, 1, 4), kv_cache, torch.tensor([[2, 3]]),
                                               torch.tensor([4]), window=2)
    torch.testing.assert_close(out, torch.ones(1, 1, 4))


def test_kernel_reads_only_the_context():
    kv_cache = torch.zeros(layer_shape(4, 2, 1, 4))
    token_major(kv_cache)[1, 2, 0] = 1.0  # V of the only context token (block 2, offset 0)
    kv_cache[:, 3] = 1e6  # a neighbouring block that must not be read
    out = decode_kernel.paged_decode_attention(
        torch.ones(1, 1, 4), kv_cache, torch.tensor([[2, 3]]), torch.tensor([1])
    )
    torch.testing.assert_close(out, torch.ones(1, 1, 4))


def test_kernel_refuses_queries_that_are_not_float32():
    kv_cache = torch.zeros(layer_shape(4, 2, 1, 4))
    with pytest.raises(ValueError, match="float32"):
        decode_kernel.paged_decode_attention(torch.ones(1, 1, 4, dtype=torch.float16), kv_cache,
                                             torch.tensor([[2, 3]]), torch.tensor([1]))


@pytest.mark.parametrize("num_seqs", [1, 5])
def test_kernel_reads_queries_in_place_from_the_fused_qkv_rows(num_seqs):
    """q as the layer hands it over, a slice of each row of the fused qkv output (rows further apart than one
    query's heads): the same output, bit for bit, as from a contiguous copy."""
    torch.manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 8
    kv_cache = torch.randn(layer_shape(16, block_size, num_kv_heads, head_dim))
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    assert not q.is_contiguous() or num_seqs == 1
    tables = torch.randperm(16)[: num_seqs * 3].view(num_seqs, 3).contiguous()
    lens = torch.tensor([24 - i for i in range(num_seqs)])
    in_place = decode_kernel.paged_decode_attention(q, kv_cache, tables, lens)
    assert torch.equal(in_place, decode_kernel.paged_decode_attention(q.contiguous(), kv_cache, tables, lens))
    # A view whose heads are not side by side is copied first, not misread.
    transposed = torch.randn(num_seqs, head_dim, num_heads).transpose(1, 2)
    assert torch.equal(decode_kernel.paged_decode_attention(transposed, kv_cache, tables, lens),
                       decode_kernel.paged_decode_attention(transposed.contiguous(), kv_cache, tables, lens))


def _reference(q, kv_cache, tables, lens, scale, window, softcap):
    """Decode attention in float64 straight from the definition: each sequence's keys gathered through its table."""
    kv_cache = token_major(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for b, length in enumerate(lens.tolist()):
        rows = [tables[b, t // block_size].item() * block_size + t % block_size for t in range(length)]
        first = max(0, length - window) if window else 0
        k, v = (kv_cache[i].reshape(-1, num_kv_heads, head_dim)[rows[first:]].double() for i in (0, 1))
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, H, D]
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), v).float()
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(8, 4, 32, 16), (12, 4, 64, 16), (4, 1, 128, 16), (6, 3, 24, 16), (4, 2, 20, 16),
                          (8, 8, 64, 5), (9, 3, 64, 32), (16, 4, 64, 16), (16, 1, 16, 16), (16, 1, 32, 16),
                          (4, 4, 64, 32), (4, 4, 128, 16), (8, 2, 32, 16)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (37, None), (None, 3.0)])
def test_kernel_matches_the_definition_on_long_scattered_contexts(num_heads, num_kv_heads, head_dim, block_size,
                                                                  window, softcap):
    """The head sizes with code of their own (32, 64, 128), others that are multiples of 8 (24) or not (20), keys
    scored eight at a time with tiles cut by block ends (block size 5, 32) and by a window's first key, and
    contexts whose length is no multiple of anything: all equal the definition. With AVX-512, GQA groups whose
    query heads fill at most 16 vectors (16 x 64 / 4, 16 x 16 / 1) take the row-by-row group code, and larger ones
    (4 x 128 / 1, 16 x 32 / 1) the AVX2 tiles. Groups of 1-4 with room for a tile's accumulators score 16 / group
    keys at a time (8 x 32 / 4: 8 keys, 12 x 64 / 4: 5, 8 x 32 / 2: 4, 4 x 64 / 4 and 4 x 128 / 4: 16; the rest of a
    span row by row; never with a soft-cap)."""
    torch.manual_seed(2)
    lens = torch.tensor([1, 7, 8, 9, 17, 63, 100, 203], dtype=torch.int64)
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = len(lens) * width + 3
    kv_cache = torch.randn(layer_shape(num_blocks, block_size, num_kv_heads, head_dim))
    tables = torch.randperm(num_blocks)[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), num_heads, head_dim)
    scale = head_dim ** -0.5
    out = decode_kernel.paged_decode_attention(q, kv_cache, tables, lens, scale=scale, window=window, softcap=softcap)
    torch.testing.assert_close(out, _reference(q, kv_cache, tables, lens, scale, window, softcap),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_matmul_pool_and_openmp_give_the_same_bits(threads, monkeypatch):
    """Sequences go out on the panel matmul's thread pool where it loads (csrc/paged_decode_attention.c), else
    in an OpenMP region; each sequence is computed alone either way, so the outputs are equal bit for bit."""
    library = decode_kernel.load()
    if decode_kernel.panel_gemm.pool_run_address() is None:
        pytest.skip("the panel matmul's library is not available")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(3)
    lens = torch.tensor([5, 130, 1, 257, 64, 300, 129, 2, 90], dtype=torch.int64)
    width = int((lens.max() + 127) // 128)
    kv_cache = torch.randn(layer_shape(len(lens) * width + 2, 128, 4, 32))
    tables = torch.randperm(len(lens) * width + 2)[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), 8, 32)
    try:
        decode_kernel.share_the_matmul_pool(library, share=False)
        openmp = decode_kernel.paged_decode_attention(q, kv_cache, tables, lens)
    finally:
        decode_kernel.share_the_matmul_pool(library)
    pooled = decode_kernel.paged_decode_attention(q, kv_cache, tables, lens)
    assert torch.equal(pooled, openmp)
    torch.testing.assert_close(pooled, _reference(q, kv_cache, tables, lens, 32 ** -0.5, None, None),
                               atol=2e-5, rtol=2e-5)
