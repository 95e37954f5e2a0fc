"""The physical store of KV blocks: reference counts, the prefix-cache hash table and the free LRU.

A block is in exactly one of three states:
- used: ref_count > 0 (held by one or more block tables);
- cached: ref_count == 0 but it still holds a hash, so a later prefix hit can revive it;
- free: ref_count == 0 and no hash.
Cached and free blocks both sit in one free queue, ordered by what should be reused first: blocks
without a hash at the front (nothing is lost by reusing them), cached blocks at the back in the order
they were released (least recently used first). Allocating a cached block evicts its hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """allocate() on an empty pool: callers must check num_free_blocks first."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        # Front = next block handed out. Values unused: OrderedDict gives O(1) removal from the middle.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id, for used and cached blocks alike

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for block_id in self._free_queue if self._hashes[block_id] is not None)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """The free queue in reuse order (first = allocated next)."""
        return list(self._free_queue)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_queue

    # ---- state changes -------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take the block at the front of the free queue, evicting its hash if it has one."""
        if not self._free_queue:
            raise NoFreeBlocksError("no free KV blocks")
        block_id, _ = self._free_queue.popitem(last=False)
        self._evict_hash(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def allocate_many(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {self.num_free_blocks} free")
        return [self.allocate() for _ in range(num_blocks)]

    def touch(self, block_id: int) -> None:
        """Take a reference on a prefix-cache hit; a cached block with no holders leaves the free queue."""
        if self._ref_counts[block_id] == 0:
            if self._hashes[block_id] is None:
                raise ValueError(f"block {block_id} is free and holds no cached content")
            del self._free_queue[block_id]
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block joins the free queue (front if unhashed, back if cached)."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} freed more often than it was taken")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] > 0:
            return
        self._free_queue[block_id] = None
        if self._hashes[block_id] is None:
            self._free_queue.move_to_end(block_id, last=False)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Release a block table tail first, so that a prompt's tail is evicted before its head (the head
        is the part other requests are most likely to share)."""
        for block_id in reversed(list(block_ids)):
            self.free(block_id)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Publish a used, full block under `block_hash`. False (and nothing changes) when another block
        already holds that hash or this block already has one: the first copy stays the shared one."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use; only held blocks can be cached")
        if self._hashes[block_id] is not None or block_hash in self.cached:
            return False
        self._hashes[block_id] = block_hash
        self.cached[block_hash] = block_id
        return True

    def reset_hashes(self) -> None:
        """Forget every hash. Held blocks keep their content for their holders but are no longer shared;
        released cached blocks become plain free blocks (moved to the front)."""
        for block_id in self.cached.values():
            self._hashes[block_id] = None
            if block_id in self._free_queue:
                self._free_queue.move_to_end(block_id, last=False)
        self.cached.clear()

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            self._hashes[block_id] = None
            del self.cached[block_hash]

    # ---- invariants ----------------------------------------------------------------------------
    def integrity_problems(self, holders: list[int]) -> list[str]:
        """Describe every broken invariant; `holders[b]` is how many block tables hold block b."""
        problems: list[str] = []
        num_used = sum(1 for count in self._ref_counts if count > 0)
        num_cached_free = self.num_cached_free_blocks
        num_plain_free = self.num_free_blocks - num_cached_free
        if num_plain_free + num_cached_free + num_used != self.num_blocks:
            problems.append(
                f"free ({num_plain_free}) + cached-unreferenced ({num_cached_free}) + used ({num_used}) "
                f"!= total ({self.num_blocks})"
            )
        for block_id, count in enumerate(self._ref_counts):
            problems.extend(self._block_problems(block_id, count, holders[block_id]))
        for block_hash, block_id in self.cached.items():
            if self._hashes[block_id] != block_hash:
                problems.append(f"cached maps a hash to block {block_id}, which holds another hash")
        num_hashed = sum(1 for block_hash in self._hashes if block_hash is not None)
        if num_hashed != len(self.cached):
            problems.append(f"{num_hashed} blocks carry a hash but the cached table has {len(self.cached)}")
        return problems

    def _block_problems(self, block_id: int, count: int, num_holders: int) -> list[str]:
        problems = []
        if count != num_holders:
            problems.append(f"block {block_id}: ref_count {count} but held by {num_holders} block tables")
        if count < 0:
            problems.append(f"block {block_id}: negative ref_count {count}")
        if count > 0 and block_id in self._free_queue:
            problems.append(f"block {block_id}: in the free queue while referenced ({count})")
        if count == 0 and block_id not in self._free_queue:
            problems.append(f"block {block_id}: unreferenced but missing from the free queue (leaked)")
        block_hash = self._hashes[block_id]
        if block_hash is not None and self.cached.get(block_hash) != block_id:
            problems.append(f"block {block_id}: carries a hash the cached table does not map to it")
        return problems
