"""The fused CPU element-wise kernels against the torch ops they replace, and their fallback."""

import pytest
import torch
import torch.nn.functional as F

from flotilla.engine.model import fused_ops
from flotilla.engine.model.kv_cache import cache_rows, layer_shape
from flotilla.engine.model.rope import apply_rotary
from tests.support.kernels import needs_kernels

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def two_threads():
    """The suite runs torch on one thread (tests/conftest.py); the kernels' threaded passes (1M elements and up)
    need two to run threaded."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def torch_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernels
@pytest.mark.parametrize(("rows", "n"), [(1, 8), (7, 257), (300, 768), (3, 1), (1400, 769)])  # the last runs threaded
def test_rms_norm_and_residual_add_match_torch(rows, n):
    torch.manual_seed(0)
    x, delta, weight = torch.randn(rows, n) * 3, torch.randn(rows, n), torch.randn(n)
    expected_sum = x + delta
    expected = torch_rms_norm(expected_sum, weight, 1e-6)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6),
                               atol=2e-6, rtol=2e-6)
    summed, normed = fused_ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(summed, expected_sum)  # the add is exact, written into x
    assert summed.data_ptr() == x.data_ptr()
    torch.testing.assert_close(normed, expected, atol=2e-6, rtol=2e-6)


@needs_kernels
@pytest.mark.parametrize(("rows", "n"), [(1, 5), (9, 704), (130, 2304), (500, 2305)])  # the last runs threaded
def test_silu_mul_matches_torch(rows, n):
    torch.manual_seed(1)
    gate_up = torch.randn(rows, 2 * n) * 4
    gate_up[0, : min(n, 4)] = torch.tensor([-100.0, 100.0, -88.5, 89.0])[: min(n, 4)]  # past exp's float range
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary_dim"),
                         [(12, 4, 64, 64), (8, 8, 16, 16), (6, 2, 10, 6), (4, 1, 32, 16)])
def test_rope_in_place_equals_apply_rotary(heads, kv_heads, head_dim, rotary_dim):
    """GQA, odd head counts, partial rotary: q and k rotated, v untouched, bit for bit as apply_rotary."""
    torch.manual_seed(2)
    rows = 1100 if heads == 12 else 11  # 1100 rows of 12 + 4 heads of 64 run threaded
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    angles = torch.randn(rows, 1, rotary_dim // 2).repeat(1, 1, 2) * 5
    cos_sin = torch.stack((angles.cos(), angles.sin()))  # [2, T, 1, rotary_dim], halves repeated as in RoPE
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = apply_rotary(q.reshape(rows, heads, head_dim), cos_sin)
    expected_k = apply_rotary(k.reshape(rows, kv_heads, head_dim), cos_sin)
    expected_v = v.clone()
    assert fused_ops.rope_in_place(qkv, cos_sin, heads, kv_heads, head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(q.reshape(rows, heads, head_dim), expected_q)
    assert torch.equal(k.reshape(rows, kv_heads, head_dim), expected_k)
    assert torch.equal(v, expected_v)


@needs_kernels
@pytest.mark.parametrize(("num_tokens", "heads", "kv_heads", "head_dim"),
                         [(1, 8, 2, 16), (64, 12, 4, 64), (37, 6, 3, 24), (4200, 8, 4, 64)])  # the last runs threaded
def test_write_rows_puts_each_new_key_where_index_copy_does(num_tokens, heads, kv_heads, head_dim):
    """K read in place from the fused qkv rows into the cache rows of kv_cache.cache_rows: the cache afterwards
    equals index_copy_'s from a contiguous copy, everything else untouched."""
    torch.manual_seed(5)
    block_size = 16
    num_blocks = -(-num_tokens // block_size) * 2 + 1
    cache = torch.randn(layer_shape(num_blocks, block_size, kv_heads, head_dim))[0]
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    rows = cache_rows(slots, torch.empty(layer_shape(num_blocks, block_size, kv_heads, head_dim)))
    expected = cache.clone()
    expected.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim))
    assert fused_ops.write_rows(cache, rows, k)
    assert torch.equal(cache, expected)


@needs_kernels
def test_write_rows_refuses_a_row_outside_the_cache_and_writes_nothing():
    cache = torch.zeros(layer_shape(2, 4, 2, 8))[0]
    values = torch.ones(3, 2, 8)
    rows = torch.tensor([0, 1, 2, 3, 4, cache.numel() // 8])  # the last is one past the end
    with pytest.raises(IndexError):
        fused_ops.write_rows(cache, rows, values)
    assert not cache.any()
    in_range = torch.arange(6)
    assert not fused_ops.write_rows(cache.half(), in_range, values)  # not float32: the caller's index_copy_
    assert not fused_ops.write_rows(cache, in_range.int(), values)  # int32 rows: likewise
    assert fused_ops.write_rows(cache, in_range, values) and cache.view(-1, 8)[:6].eq(1).all()


def test_disabled_kernels_fall_back_to_torch(monkeypatch):
    """FLOTILLA_DISABLE_KERNELS (or no compiler): the torch ops, the residual sum a new tensor."""
    monkeypatch.setenv("FLOTILLA_DISABLE_KERNELS", "1")
    assert fused_ops.load() is None
    torch.manual_seed(3)
    x, delta, weight = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24)
    summed, normed = fused_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert summed.data_ptr() != x.data_ptr()
    assert torch.equal(normed, torch_rms_norm(x + delta, weight, 1e-5))
    gate_up = torch.randn(3, 10)
    assert torch.equal(fused_ops.silu_mul(gate_up), F.silu(gate_up[:, :5]) * gate_up[:, 5:])
    assert not fused_ops.rope_in_place(torch.randn(2, 48), torch.randn(2, 2, 1, 8), 2, 1, 8)


@needs_kernels
def test_non_contiguous_and_other_dtypes_take_the_torch_path():
    x = torch.randn(6, 16, dtype=torch.float64)
    weight = torch.randn(16, dtype=torch.float64)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
    strided = torch.randn(16, 6).t()
    torch.testing.assert_close(fused_ops.rms_norm(strided, torch.ones(16), 1e-6),
                               torch_rms_norm(strided, torch.ones(16), 1e-6))
