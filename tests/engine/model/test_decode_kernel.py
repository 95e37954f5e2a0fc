"""The CPU decode kernel reads K/V through block tables and must agree with the SDPA path."""

import pytest
import torch

from flotilla.engine.model import decode_kernel
from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention

pytestmark = pytest.mark.skipif(decode_kernel.load() is None, reason="no C compiler for the CPU kernel")


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 4, 32), (4, 4, 16), (12, 2, 64), (8, 1, 8)])
def test_kernel_matches_sdpa_path(num_heads, num_kv_heads, head_dim):
    torch.manual_seed(0)
    block_size, num_blocks = 4, 64
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
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
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
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
    kv_cache = torch.zeros(2, 4, 2, 1, 4)
    kv_cache[1, 3] = 1.0  # V of context tokens 2 and 3 (block 3)
    kv_cache[:, 2] = float("nan")  # tokens 0 and 1, outside a window of 2: never read
    out = decode_kernel.paged_decode_attention(torch.ones(1, 1, 4), kv_cache, torch.tensor([[2, 3]]),
                                               torch.tensor([4]), window=2)
    torch.testing.assert_close(out, torch.ones(1, 1, 4))


def test_kernel_reads_only_the_context():
    kv_cache = torch.zeros(2, 4, 2, 1, 4)
    kv_cache[1, 2, 0] = 1.0  # V of the only context token (block 2, offset 0)
    kv_cache[:, 3] = 1e6  # a neighbouring block that must not be read
    out = decode_kernel.paged_decode_attention(
        torch.ones(1, 1, 4), kv_cache, torch.tensor([[2, 3]]), torch.tensor([1])
    )
    torch.testing.assert_close(out, torch.ones(1, 1, 4))
