"""KV cache manager: block tables, prefix hits, copy-on-write, eviction order, swap, integrity."""

import pytest

from flotilla.engine.block_hash import chain_root
from flotilla.engine.kv_cache_manager import ComputedBlocks, KVCacheIntegrityError, KVCacheManager
from flotilla.engine.request import Request
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.scheduler_output import BlockCopy

BS = 4


def _request(request_id: str, tokens: list[int], salt: str = "") -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def _run(kv: KVCacheManager, request: Request, num_tokens: int | None = None, computed=None):
    """Allocate and 'run' one chunk (the engine would advance num_computed_tokens after the step)."""
    if num_tokens is None:
        start = computed.num_tokens if computed is not None else request.num_computed_tokens
        num_tokens = request.num_tokens - start
    copies = kv.allocate_slots(request, num_tokens, computed)
    assert copies is not None
    request.num_computed_tokens += num_tokens
    kv.end_step()
    return copies


def _snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        dict(kv._tables),
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        pool.free_block_ids(),
        dict(pool.cached),
        kv.num_prefix_queries_tokens,
    )


def test_allocate_covers_tokens_with_exact_blocks():
    kv = KVCacheManager(10, BS)
    request = _request("a", range(10))
    assert kv.allocate_slots(request, 10) == []
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)
    request.num_computed_tokens = 10
    request.output_token_ids.append(99)
    assert kv.allocate_slots(request, 1) == []  # token 10 still fits block 2
    assert kv.block_ids("a") == [0, 1, 2]
    request.num_computed_tokens = 11
    request.output_token_ids.append(98)
    kv.allocate_slots(request, 1, num_lookahead_tokens=2)  # 11 + 1 + 2 = 14 tokens -> 4 blocks
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.check_integrity()


def test_prefix_hit_shares_full_blocks_and_counts_stats():
    kv = KVCacheManager(10, BS)
    first = _request("a", range(10))
    _run(kv, first)
    second = _request("b", [0, 1, 2, 3, 4, 5, 6, 7, 50, 51])
    computed = kv.get_computed_blocks(second)
    assert computed == ComputedBlocks([0, 1], 8)
    assert kv.pool.ref_count(0) == 1  # lookup changed nothing
    assert kv.allocate_slots(second, 2, computed) == []
    assert kv.block_ids("b") == [0, 1, 3]
    assert second.num_computed_tokens == 8
    assert second.num_cached_prompt_tokens == 8
    assert kv.pool.ref_count(0) == kv.pool.ref_count(1) == 2
    assert (kv.num_prefix_queries_tokens, kv.num_prefix_hit_tokens) == (20, 8)
    assert kv.prefix_hit_rate == pytest.approx(0.4)
    assert kv.check_integrity()


def test_fully_cached_prompt_recomputes_last_token_with_copy_on_write():
    # Regression (nano-vllm): a 100% cached prompt left nothing to compute, so no logits.
    kv = KVCacheManager(10, BS)
    first = _request("a", range(8))
    _run(kv, first)  # blocks 0, 1 published
    kv.free(first)
    assert kv.pool.free_block_ids()[-2:] == [1, 0]
    second = _request("b", range(8))
    computed = kv.get_computed_blocks(second)
    assert computed == ComputedBlocks([0, 1], 7)
    copies = kv.allocate_slots(second, 1, computed)
    # The last block is cached (immutable): token 7 is written into a fresh copy, block 2.
    assert copies == [BlockCopy(src=1, dst=2)]
    assert kv.block_ids("b") == [0, 2]
    assert second.num_computed_tokens == 7
    assert second.num_cached_prompt_tokens == 7
    assert kv.pool.ref_count(1) == 1  # the copy source is held until the step's copies have run
    assert kv.pool.block_hash(2) is None  # the copy duplicates a published hash: stays private
    assert kv.check_integrity()
    kv.end_step()
    assert kv.pool.ref_count(1) == 0 and kv.pool.get_cached_block(kv.pool.block_hash(1)) == 1
    assert kv.pool.free_block_ids()[-1] == 1  # back in the cached LRU
    assert kv.check_integrity()


def test_fully_cached_prompt_shared_with_a_running_request():
    kv = KVCacheManager(10, BS)
    first = _request("a", range(8))
    _run(kv, first)
    second = _request("b", range(8))
    computed = kv.get_computed_blocks(second)
    assert kv.allocate_slots(second, 1, computed) == [BlockCopy(src=1, dst=2)]
    assert kv.block_ids("a") == [0, 1]
    assert kv.block_ids("b") == [0, 2]
    kv.end_step()
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert kv.check_integrity()


def test_block_published_this_step_is_not_a_copy_source():
    # Same prompt admitted twice in one step: the first request's blocks are only written during the
    # step, after copies run, so the second must recompute the last block instead of copying it.
    kv = KVCacheManager(10, BS)
    kv.end_step()
    first = _request("a", range(8))
    kv.allocate_slots(first, 8)
    second = _request("b", range(8))
    computed = kv.get_computed_blocks(second)
    assert computed == ComputedBlocks([0], 4)
    assert kv.allocate_slots(second, 4, computed) == []
    assert kv.block_ids("b") == [0, 2]
    kv.end_step()  # next step: block 1 is written now, a copy source is fine
    assert kv.get_computed_blocks(_request("c", range(8))) == ComputedBlocks([0, 1], 7)


def test_chunk_crossing_block_boundary_publishes_only_full_blocks():
    # Regression (nano-vllm): a chunk ending mid-block hashed the partial block.
    kv = KVCacheManager(10, BS)
    request = _request("a", range(10))
    _run(kv, request, 3)
    assert kv.pool.cached == {}
    _run(kv, request, 3)  # tokens 3..5 cross into block 1: block 0 is full now
    assert kv.block_ids("a") == [0, 1]
    assert list(kv.pool.cached.values()) == [0]
    _run(kv, request, 4)  # tokens 6..9: block 1 full, block 2 partial
    assert sorted(kv.pool.cached.values()) == [0, 1]
    probe = _request("b", list(range(10)) + [77])
    assert kv.get_computed_blocks(probe) == ComputedBlocks([0, 1], 8)


def test_output_tokens_are_published_too():
    kv = KVCacheManager(10, BS)
    request = _request("a", range(3))
    _run(kv, request)
    request.output_token_ids.append(42)
    _run(kv, request)  # token 3 (the output) fills block 0
    probe = _request("b", [0, 1, 2, 42, 5])
    assert kv.get_computed_blocks(probe) == ComputedBlocks([0], 4)


def test_different_cache_salt_never_hits():
    kv = KVCacheManager(10, BS)
    _run(kv, _request("a", range(9), salt="tenant-1"))
    assert kv.get_computed_blocks(_request("b", range(9), salt="tenant-2")) == ComputedBlocks([], 0)
    assert kv.get_computed_blocks(_request("c", range(9), salt="")) == ComputedBlocks([], 0)
    assert kv.get_computed_blocks(_request("d", range(9), salt="tenant-1")) == ComputedBlocks([0, 1], 8)


def test_different_cache_root_never_hits():
    """A chain root (block_hash.chain_root: K/V rotated by the prompt's length) separates equal tokens and salts."""
    kv = KVCacheManager(10, BS)
    rooted = Request("a", list(range(9)), SamplingParams(max_tokens=8), cache_root=chain_root("dynamic:40"))
    _run(kv, rooted)
    assert kv.get_computed_blocks(_request("b", range(9))) == ComputedBlocks([], 0)
    other = Request("c", list(range(9)), SamplingParams(max_tokens=8), cache_root=chain_root("dynamic:41"))
    assert kv.get_computed_blocks(other) == ComputedBlocks([], 0)
    same = Request("d", list(range(9)), SamplingParams(max_tokens=8), cache_root=chain_root("dynamic:40"))
    assert kv.get_computed_blocks(same) == ComputedBlocks([0, 1], 8)
    assert chain_root(None) is None


def test_prefix_caching_disabled_never_hits_or_publishes():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    _run(kv, _request("a", range(9)))
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(_request("b", range(9))) == ComputedBlocks([], 0)


def test_refusal_changes_nothing():
    kv = KVCacheManager(4, BS)
    holder = _request("a", range(8))
    _run(kv, holder)
    kv.free(holder)  # blocks 0, 1 cached and unreferenced
    squatter = _request("s", [90])
    _run(kv, squatter)  # takes block 2
    request = _request("b", list(range(8)) + list(range(20, 28)))  # hits 2 blocks, needs 2 more
    computed = kv.get_computed_blocks(request)
    assert computed == ComputedBlocks([0, 1], 8)
    assert kv.num_blocks_needed(request, 16, computed) == 4  # 2 revived + 2 new, only 3 free
    before = _snapshot(kv)
    assert kv.allocate_slots(request, 8, computed) is None
    assert _snapshot(kv) == before
    assert request.num_computed_tokens == 0
    assert kv.check_integrity()


def test_stale_hash_after_reuse_never_hits():
    kv = KVCacheManager(3, BS)
    old = _request("a", range(8))
    _run(kv, old)
    kv.free(old)  # blocks 0, 1 cached
    _run(kv, _request("b", [100, 101, 102, 103, 104]))  # takes 2, then evicts 1 (the tail) first
    assert kv.block_ids("b") == [2, 1]
    assert kv.get_computed_blocks(_request("c", range(8))) == ComputedBlocks([0], 4)
    _run(kv, _request("d", [200]))  # evicts 0
    assert kv.get_computed_blocks(_request("e", range(8))) == ComputedBlocks([], 0)
    assert kv.check_integrity()


def test_stale_computed_blocks_are_refused():
    kv = KVCacheManager(2, BS)
    holder = _request("x", range(5))
    _run(kv, holder)
    kv.free(holder)  # block 0 cached, block 1 plain free
    later = _request("y", range(5))
    computed = kv.get_computed_blocks(later)
    assert computed == ComputedBlocks([0], 4)
    _run(kv, _request("z", [7] * 8))  # takes both blocks, evicting block 0's hash
    with pytest.raises(ValueError, match="no longer holds"):
        kv.allocate_slots(later, 1, computed)


def test_eviction_order_unhashed_first_then_tail_first():
    kv = KVCacheManager(8, BS)
    request = _request("a", range(14))  # blocks 0, 1, 2 full (cached), 3 partial (unhashed)
    _run(kv, request)
    kv.free(request)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    taker = _request("b", range(100, 100 + 7 * BS))
    _run(kv, taker)
    assert kv.block_ids("b") == [3, 4, 5, 6, 7, 2, 1]
    probe = _request("c", range(14))
    assert kv.get_computed_blocks(probe) == ComputedBlocks([0], 4)  # the head survived longest


def test_prefix_hit_refreshes_lru_position():
    kv = KVCacheManager(4, BS)
    a = _request("a", range(4))
    b = _request("b", range(50, 54))
    _run(kv, a)
    _run(kv, b)
    kv.free(a)  # queue: 2, 3, 0
    kv.free(b)  # queue: 2, 3, 0, 1
    reuse = _request("c", list(range(4)) + [9])
    computed = kv.get_computed_blocks(reuse)
    _run(kv, reuse, computed=computed)
    kv.free(reuse)  # block 0 released last: now the most recently used
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]


def test_free_returns_every_block():
    kv = KVCacheManager(10, BS)
    requests = [_request(str(i), range(i, i + 9)) for i in range(3)]
    for request in requests:
        _run(kv, request)
    for request in requests:
        kv.free(request)
    assert kv.num_free_blocks == 10
    assert kv.block_ids("0") == []
    assert kv.check_integrity()


def test_swap_out_and_in_moves_blocks_through_host_slots():
    kv = KVCacheManager(6, BS, num_host_blocks=4)
    request = _request("a", range(10))
    _run(kv, request)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.swap_out(request) == [BlockCopy(0, 0), BlockCopy(1, 1), BlockCopy(2, 2)]
    assert kv.is_swapped(request) and kv.block_ids("a") == []
    assert kv.num_free_blocks == 6 and kv.num_free_host_blocks == 1
    with pytest.raises(ValueError, match="swap_in first"):
        kv.allocate_slots(request, 1)
    assert kv.num_blocks_needed(request, 12) == 3
    _run(kv, _request("b", [7]))  # takes block 2: the unhashed tail went to the front of the queue
    assert kv.block_ids("b") == [2]
    copies = kv.swap_in(request)
    assert copies == [BlockCopy(0, 3), BlockCopy(1, 4), BlockCopy(2, 5)]  # cached 0, 1 not evicted
    assert kv.block_ids("a") == [3, 4, 5]
    assert not kv.is_swapped(request) and kv.num_free_host_blocks == 4
    assert request.num_computed_tokens == 10  # K/V kept: nothing to recompute
    assert kv.check_integrity()


def test_swap_refused_when_slots_are_short():
    kv = KVCacheManager(4, BS, num_host_blocks=1)
    request = _request("a", range(8))
    _run(kv, request)
    assert kv.swap_out(request) is None
    assert kv.block_ids("a") == [0, 1] and kv.num_free_host_blocks == 1
    big = KVCacheManager(2, BS, num_host_blocks=2)
    swapped = _request("a", range(8))
    _run(big, swapped)
    big.swap_out(swapped)
    _run(big, _request("b", [1]))
    assert big.swap_in(swapped) is None
    assert big.is_swapped(swapped)
    big.free(swapped)
    assert big.num_free_host_blocks == 2
    assert big.check_integrity()


def test_reset_prefix_cache_forgets_hits():
    kv = KVCacheManager(6, BS)
    request = _request("a", range(9))
    _run(kv, request)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_request("b", range(9))) == ComputedBlocks([], 0)
    kv.free(request)
    assert kv.num_free_blocks == 6
    assert kv.check_integrity()


def test_check_integrity_detects_corruption():
    kv = KVCacheManager(6, BS)
    request = _request("a", range(9))
    _run(kv, request)
    kv._tables["ghost"] = [0]  # a table holding a block without a reference
    with pytest.raises(KVCacheIntegrityError, match="block 0: ref_count 1 but held by 2"):
        kv.check_integrity()
    del kv._tables["ghost"]
    kv.pool._hashes[5] = b"x" * 32  # hash not in the cached table
    with pytest.raises(KVCacheIntegrityError, match="block 5"):
        kv.check_integrity()


def test_invalid_allocations_raise():
    kv = KVCacheManager(6, BS)
    request = _request("a", range(5))
    with pytest.raises(ValueError, match="only 5 are known"):
        kv.allocate_slots(request, 6)
    with pytest.raises(ValueError):
        kv.allocate_slots(request, -1)
    with pytest.raises(ValueError, match="at least one token"):
        kv.allocate_slots(request, 0, ComputedBlocks([0, 1], 8))


def test_copy_source_stays_held_until_end_step():
    # A copy-on-write source must not be reused within its step: the model runner may apply swap-ins
    # before block copies, and a swap-in landing in the source would corrupt the copy.
    kv = KVCacheManager(3, BS, num_host_blocks=2)
    first = _request("a", range(8))
    _run(kv, first)
    kv.free(first)  # queue: 2, then cached 1, 0
    swapped = _request("p", range(20, 24))
    _run(kv, swapped)  # takes block 2
    assert kv.swap_out(swapped) == [BlockCopy(src=2, dst=0)]  # queue: 1, 0, 2 (all cached)
    again = _request("b", range(8))
    copies = kv.allocate_slots(again, 1, kv.get_computed_blocks(again))
    assert copies == [BlockCopy(src=1, dst=2)]
    assert kv.pool.free_block_ids() == []
    assert kv.swap_in(swapped) is None  # block 1 is still being copied from
    assert kv.check_integrity()
    kv.end_step()
    assert kv.swap_in(swapped) == [BlockCopy(src=0, dst=1)]
    assert kv.check_integrity()


def test_check_integrity_reports_tables_of_no_live_request():
    kv = KVCacheManager(6, BS, num_host_blocks=4)
    live, orphan, swapped = _request("live", range(5)), _request("orphan", range(5)), _request("swapped", range(5))
    for request in (live, orphan, swapped):
        _run(kv, request)
    assert kv.swap_out(swapped) is not None
    assert kv.check_integrity()  # without the live set, only the block accounting is checked
    with pytest.raises(KVCacheIntegrityError) as caught:
        kv.check_integrity(live_request_ids={"live"})
    assert "request orphan: holds device blocks" in str(caught.value)
    assert "request swapped: holds host slots" in str(caught.value)
    assert "request live" not in str(caught.value)
    kv.free(orphan)
    kv.free(swapped)
    assert kv.check_integrity(live_request_ids={"live"})
