"""The CPU prefill-attention kernel against the definition (float64 softmax attention over the context gathered
through the block table): shuffled block tables, GQA, head sizes the kernel compiles apart and others, chunks
after a prefix, windows, soft-caps, query rows that are a strided slice of the fused qkv, and lengths that leave
partial query and key tiles."""


import pytest
import torch

from flotilla.engine.model import prefill_kernel
from flotilla.engine.model.kv_cache import layer_shape, token_major
from tests.support.kernels import kernel_build_fixture, needs_kernels

pytestmark = [pytest.mark.unit, needs_kernels]


def definition(q, kv_cache, table, start, scale, window=None, softcap=None):
    num_queries, num_heads, head_dim = q.shape
    kv_cache = token_major(kv_cache)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    context_len = start + num_queries
    gathered = kv_cache[:, table].reshape(2, -1, num_kv_heads, head_dim)[:, :context_len].double()
    keys = gathered[0].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
    values = gathered[1].repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(start, context_len)[:, None]
    key_pos = torch.arange(context_len)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(scores, dim=-1), values).float()


CASES = [  # (queries, start, heads, kv heads, head dim, block size, window, softcap)
    (37, 0, 8, 4, 32, 16, None, None),
    (37, 21, 8, 4, 32, 4, None, None),  # a chunk after a prefix, blocks of 4
    (64, 0, 12, 4, 64, 16, None, None),  # exactly one query tile
    (130, 300, 9, 3, 64, 16, None, None),  # partial tiles, a long prefix
    (17, 0, 4, 4, 128, 16, None, None),
    (5, 3, 6, 2, 24, 16, None, None),  # a head size compiled generically
    (50, 100, 12, 4, 64, 16, 30, None),  # a window smaller than the chunk
    (40, 0, 8, 2, 16, 4, 8, 3.0),  # window and soft-cap (Gemma 2's shape)
    (2, 0, 2, 1, 8, 16, None, None),  # two queries, G 2
    (1, 9, 4, 2, 32, 16, None, None),  # one query past a prefix
    (300, 0, 8, 4, 32, 16, None, None),  # several query tiles and key blocks from position 0
    (200, 90, 12, 4, 64, 16, 100, None),  # a window spanning key blocks that starts inside one
]


kernel_build = kernel_build_fixture(prefill_kernel)  # "native" and "avx2" (tests/support/kernels.py)


@pytest.mark.parametrize(("num_queries", "start", "heads", "kv_heads", "head_dim", "block_size", "window", "softcap"),
                         CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_the_definition(num_queries, start, heads, kv_heads, head_dim, block_size, window, softcap,
                                          threads, kernel_build):
    generator = torch.Generator().manual_seed(num_queries * 31 + start)
    context_len = start + num_queries
    num_blocks = -(-context_len // block_size)
    kv_cache = torch.randn(layer_shape(num_blocks + 7, block_size, kv_heads, head_dim), generator=generator)
    table = torch.randperm(num_blocks + 7, generator=generator)[:num_blocks]  # scattered, out of order
    qkv = torch.randn(num_queries, (heads + 2 * kv_heads) * head_dim, generator=generator) * 2
    q = qkv[:, : heads * head_dim].view(num_queries, heads, head_dim)  # rows a stride of the fused qkv apart
    scale = head_dim ** -0.5 * 1.3
    out = torch.full((num_queries, heads, head_dim), float("nan"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prefill_kernel.paged_prefill_attention(q, kv_cache, table, start, out, scale, window, softcap)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, definition(q, kv_cache, table, start, scale, window, softcap),
                               atol=2e-5, rtol=2e-5)


def test_the_kernel_does_not_apply_to_16_bit_or_odd_head_sizes():
    assert prefill_kernel.applies(torch.zeros(layer_shape(1, 16, 2, 32)))
    assert not prefill_kernel.applies(torch.zeros(layer_shape(1, 16, 2, 32), dtype=torch.bfloat16))
    assert not prefill_kernel.applies(torch.zeros(layer_shape(1, 16, 2, 20)))


def test_a_bad_output_tensor_is_refused():
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="contiguous"):
        prefill_kernel.paged_prefill_attention(q, torch.randn(layer_shape(1, 16, 1, 8)), torch.tensor([0]), 0,
                                               torch.empty(4, 8, 2).transpose(1, 2))


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (40, None), (None, 2.5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_for_a_steps_chunks_equals_each_chunk_alone(window, softcap, threads, kernel_build):
    """A step's prefill chunks in one call (rows side by side in q and out, tables padded to one width, decode
    rows between them left alone) give each chunk what the definition gives it alone."""
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    chunks = [(0, 150), (64, 3), (130, 70), (0, 2)]  # (start, queries): long and short, from 0 and after a prefix
    rows_between = 5  # rows of other sequences between chunks (decode rows in the engine's step)
    widths = [-(-(start + count) // block_size) for start, count in chunks]
    num_blocks = sum(widths) + 5
    kv_cache = torch.randn(layer_shape(num_blocks, block_size, kv_heads, head_dim), generator=generator)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(chunks), max(widths), dtype=torch.int64)
    taken, row_offsets, row = 0, [], 0
    for c, width in enumerate(widths):
        tables[c, :width] = order[taken:taken + width]
        taken += width
        row_offsets.append(row)
        row += chunks[c][1] + rows_between
    qkv = torch.randn(row, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q = qkv[:, : heads * head_dim].view(row, heads, head_dim)
    out = torch.full((row, heads, head_dim), float("nan"))
    batch = prefill_kernel.PrefillBatch.build(tables, [s for s, _ in chunks], row_offsets, [n for _, n in chunks])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prefill_kernel.paged_prefill_attention_batch(q, kv_cache, batch, out, 0.2, window, softcap)
    finally:
        torch.set_num_threads(previous)
    for c, (start, count) in enumerate(chunks):
        rows = slice(row_offsets[c], row_offsets[c] + count)
        expected = definition(q[rows], kv_cache, tables[c, :widths[c]], start, 0.2, window, softcap)
        torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=2e-5)
        assert out[row_offsets[c] + count: row_offsets[c] + count + rows_between].isnan().all()  # not written
