"""Block pool and block hash: reference counts, LRU free queue order, hash eviction, stable hashes."""

import os
import subprocess
import sys

import pytest

from flotilla.engine.block_hash import hash_block_tokens, hash_full_blocks
from flotilla.engine.block_pool import BlockPool, NoFreeBlocksError


def _h(tag: int) -> bytes:
    return hash_block_tokens(None, [tag], "")


# ---- block hash ----------------------------------------------------------------------------------
def test_hash_is_a_fixed_digest():
    # Pinned bytes: the router compares hashes across processes and releases, so the encoding may only
    # change together with this constant (and a new _PERSON version).
    digest = hash_block_tokens(None, [1, 2, 3, 4], "tenant-a")
    assert digest.hex() == "cd60e1c2003fe8164646918f2731405b881494c385f967d4f868e36d8f96c515"


@pytest.mark.integration  # a second interpreter
def test_hash_stable_in_a_fresh_interpreter_with_another_hash_seed():
    code = (
        "from flotilla.engine.block_hash import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3, 4], 'tenant-a').hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == hash_block_tokens(None, [1, 2, 3, 4], "tenant-a").hex()


def test_hash_depends_on_parent_tokens_and_salt():
    base = hash_block_tokens(None, [1, 2], "")
    assert hash_block_tokens(None, [1, 2], "x") != base
    assert hash_block_tokens(None, [2, 1], "") != base
    assert hash_block_tokens(base, [1, 2], "") != base
    assert hash_block_tokens(None, [1, 2, 3], "") != base


def test_hash_full_blocks_chains_and_skips_partial_block():
    hashes = hash_full_blocks([1, 2, 3, 4, 5], block_size=2, salt="s")
    assert len(hashes) == 2  # token 5 is a partial block
    assert hashes[0] == hash_block_tokens(None, [1, 2], "s")
    assert hashes[1] == hash_block_tokens(hashes[0], [3, 4], "s")
    # Extending a chain gives the same hashes as hashing everything at once.
    tail = hash_full_blocks([3, 4, 5, 6], block_size=2, salt="s", parent_hash=hashes[0])
    assert tail == hash_full_blocks([1, 2, 3, 4, 5, 6], block_size=2, salt="s")[1:]


# ---- block pool ----------------------------------------------------------------------------------
def test_allocate_in_id_order_and_refuse_when_empty():
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_unhashed_blocks_go_to_front_cached_to_back():
    pool = BlockPool(6)
    blocks = pool.allocate_many(4)  # free queue: 4, 5
    pool.cache_block(blocks[0], _h(0))
    pool.free(blocks[0])  # cached -> back
    pool.free(blocks[1])  # unhashed -> front
    assert pool.free_block_ids() == [1, 4, 5, 0]
    assert pool.num_free_blocks == 4
    assert pool.num_cached_free_blocks == 1


def test_free_blocks_releases_tail_first_so_tail_is_evicted_first():
    pool = BlockPool(5)
    table = pool.allocate_many(3)
    for index, block_id in enumerate(table):
        pool.cache_block(block_id, _h(index))
    pool.free_blocks(table)
    # Queue: never-used 3, 4, then cached blocks in release order: tail (2) first, head (0) last.
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]
    assert [pool.allocate() for _ in range(5)] == [3, 4, 2, 1, 0]


def test_stale_hash_cannot_survive_block_reuse():
    # Regression (nano-vllm): a reused block kept its old hash, so a later lookup "hit" new content.
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.cache_block(block_id, _h(7))
    pool.free(block_id)
    assert pool.get_cached_block(_h(7)) == block_id  # still cached while unreferenced
    other = pool.allocate()
    reused = pool.allocate()
    assert (other, reused) == (1, 0)
    assert pool.get_cached_block(_h(7)) is None
    assert pool.block_hash(reused) is None
    assert pool.cached == {}


def test_touch_revives_cached_block_out_of_free_queue():
    pool = BlockPool(3)
    block_id = pool.allocate()
    pool.cache_block(block_id, _h(1))
    pool.free(block_id)
    assert pool.is_free(block_id)
    pool.touch(block_id)
    assert not pool.is_free(block_id)
    assert pool.ref_count(block_id) == 1
    pool.touch(block_id)
    assert pool.ref_count(block_id) == 2
    pool.free(block_id)
    assert not pool.is_free(block_id)
    pool.free(block_id)
    assert pool.free_block_ids()[-1] == block_id


def test_touch_of_plain_free_block_and_double_free_are_errors():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.touch(0)
    block_id = pool.allocate()
    pool.free(block_id)
    with pytest.raises(ValueError):
        pool.free(block_id)


def test_cache_block_keeps_first_copy_and_one_hash_per_block():
    pool = BlockPool(3)
    first, second = pool.allocate_many(2)
    assert pool.cache_block(first, _h(1))
    assert not pool.cache_block(second, _h(1))  # duplicate content: first copy stays the shared one
    assert not pool.cache_block(first, _h(2))  # a block's hash never changes while held
    assert pool.cached == {_h(1): first}
    assert pool.block_hash(second) is None
    with pytest.raises(ValueError):
        pool.cache_block(2, _h(3))  # free block


def test_reset_hashes_makes_cached_blocks_plain_free():
    pool = BlockPool(4)
    held, released = pool.allocate_many(2)
    pool.cache_block(held, _h(1))
    pool.cache_block(released, _h(2))
    pool.free(released)
    pool.reset_hashes()
    assert pool.cached == {}
    assert pool.block_hash(held) is None
    assert pool.free_block_ids() == [released, 2, 3]


def test_integrity_problems_reports_mismatch():
    pool = BlockPool(3)
    block_id = pool.allocate()
    assert pool.integrity_problems([1, 0, 0]) == []
    problems = pool.integrity_problems([0, 0, 0])
    assert any("ref_count 1 but held by 0" in p for p in problems)
    pool.free(block_id)
    pool._free_queue.pop(block_id)  # simulate a leak
    assert any("leaked" in p for p in pool.integrity_problems([0, 0, 0]))
