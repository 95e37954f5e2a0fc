"""Per-request block tables on top of the block pool: prefix-cache lookups, slot allocation with
copy-on-write, hash publishing, and swap to host slots. No tensors: the model runner moves the bytes
that the returned BlockCopy lists describe.

Before running a step the model runner applies SchedulerOutput.swap_out FIRST (its device blocks are
free again and may already be a swap-in or copy target in the same step); swap_in and block_copies may
then run in either order, since a copy-on-write source stays held until end_step().
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from flotilla.engine.block_hash import hash_full_blocks
from flotilla.engine.block_pool import BlockPool
from flotilla.engine.request import Request
from flotilla.engine.scheduler_output import BlockCopy


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: cached blocks for the head of a request and how many tokens they spare."""

    block_ids: list[int]
    num_tokens: int


class KVCacheIntegrityError(RuntimeError):
    """The block accounting is inconsistent; the message lists every broken invariant."""


class _Plan(NamedTuple):
    """What an allocation would do, computed before anything changes (so a refusal changes nothing)."""

    hit_block_ids: list[int]  # new request only: cached blocks to take references on
    start: int  # first token position this allocation writes
    num_new_blocks: int  # fresh blocks appended to the table
    copy_index: int | None  # table index of a shared/cached block that must be copied before writing
    num_revived: int  # hit blocks that sit unreferenced in the free queue (taking them uses free capacity)

    @property
    def num_blocks_taken(self) -> int:
        return self.num_new_blocks + (self.copy_index is not None) + self.num_revived


@dataclass
class _HashChain:
    """Memo of a request's full-block hashes: known tokens never change, so the chain only grows."""

    request: Request
    hashes: list[bytes] = field(default_factory=list)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.num_host_blocks = num_host_blocks
        self._tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}
        self._free_host_blocks: deque[int] = deque(range(num_host_blocks))
        self._chains: dict[str, _HashChain] = {}
        # Blocks published this step whose K/V the step itself has yet to write. Fine to share inside
        # the forward pass, but not as a copy-on-write source: copies run before the forward pass.
        self._pending: set[int] = set()
        # Copy-on-write sources whose reference we keep until the step's copies have run, so that no
        # allocation in the same step (a swap-in, say) can overwrite them before they are read.
        self._held_copy_sources: list[int] = []
        # Blocks a peer may still be writing into (an aborted KV hand-off): key -> (release time, blocks).
        # Held, so never handed to another request, until release_expired_quarantine passes that time.
        self._quarantined: dict[str, tuple[float, list[int]]] = {}
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ---- capacity and stats --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_blocks)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(blocks) for _, blocks in self._quarantined.values())

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        if self.num_prefix_queries_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queries_tokens

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._host_tables

    def end_step(self) -> None:
        """The step's copies and K/V writes are done: release held copy sources, forget what was
        pending. The scheduler calls it after each step's output (and again before planning one)."""
        self._pending.clear()
        sources, self._held_copy_sources = self._held_copy_sources, []
        for block_id in sources:
            self.pool.free(block_id)

    # ---- prefix cache --------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request's known tokens under its cache salt. Changes no cache
        state. At least one token is left to compute, since someone must produce the logits."""
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        hit_block_ids: list[int] = []
        for block_hash in self._hashes_of(request, request.num_tokens // self.block_size):
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        num_tokens = len(hit_block_ids) * self.block_size
        if hit_block_ids and num_tokens == request.num_tokens:
            if hit_block_ids[-1] in self._pending:
                hit_block_ids.pop()  # its K/V does not exist yet to be copied: recompute that block
                num_tokens -= self.block_size
            else:
                num_tokens -= 1  # recompute the last token into a copy of the last block
        return ComputedBlocks(hit_block_ids, num_tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; held blocks keep their content but are no longer shared."""
        self.pool.reset_hashes()

    # ---- allocation ----------------------------------------------------------------------------
    def num_blocks_needed(
        self, request: Request, num_tokens_total: int, computed: ComputedBlocks | None = None
    ) -> int:
        """Free blocks an allocation covering `num_tokens_total` tokens would consume (new blocks,
        copy-on-write, revived cached hits, or swap-in), so that `can_fit` of it is exact."""
        host_table = self._host_tables.get(request.request_id)
        if host_table is not None:
            return max(_cdiv(num_tokens_total, self.block_size), len(host_table))
        return self._plan(request, computed, num_tokens_total).num_blocks_taken

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        publish: bool = True,
    ) -> list[BlockCopy] | None:
        """Grow the request's block table to cover its computed tokens + `num_new_tokens` (+ lookahead).

        For a request without a table, `computed` (from get_computed_blocks; None = no hit) becomes its
        head and sets request.num_computed_tokens. Returns the copies to run before the step, or None
        with nothing changed when free blocks are short. `publish=False` keeps the new full blocks out of the
        prefix cache (their K/V arrive later, from a remote prefill); `publish_blocks` publishes them then.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_new_tokens}, {num_lookahead_tokens}")
        if request.request_id in self._host_tables:
            raise ValueError(f"request {request.request_id} is swapped out; swap_in first")
        table = self._tables.get(request.request_id)
        start = request.num_computed_tokens if table is not None and computed is None else None
        end = (start if start is not None else self._plan(request, computed, 0).start) + num_new_tokens
        if end > request.num_tokens:
            raise ValueError(
                f"request {request.request_id}: cannot compute up to token {end}, "
                f"only {request.num_tokens} are known"
            )
        if start is not None and self._extends_in_place(table, start, end + num_lookahead_tokens):
            # A running request's next tokens fit its private tail block: every decode step of almost every
            # sequence, where the general plan below costs a copy-on-write check and two plans.
            if publish:
                self._cache_full_blocks(request, table, start, end)
            return []
        start = start if start is not None else end - num_new_tokens
        plan = self._plan(request, computed, end + num_lookahead_tokens)
        if plan.num_blocks_taken > self.pool.num_free_blocks:
            return None
        table = self._take_blocks(request, plan)
        copies = self._copy_on_write(table, plan.copy_index)
        if publish:
            self._cache_full_blocks(request, table, start, end)
        return copies

    def publish_blocks(self, request: Request, start: int, end: int) -> None:
        """Publish the full blocks covering tokens [start, end) of a request whose K/V are now in place."""
        table = self._tables.get(request.request_id)
        if table is None:
            raise ValueError(f"request {request.request_id} holds no device blocks")
        pending = set(self._pending)
        self._cache_full_blocks(request, table, start, end)
        self._pending = pending  # their K/V are written already: none of them is pending

    def free(self, request: Request) -> None:
        """Release everything the request holds, device blocks (tail first) and host slots."""
        table = self._tables.pop(request.request_id, None)
        if table:
            self.pool.free_blocks(table)
        host_table = self._host_tables.pop(request.request_id, None)
        if host_table:
            self._free_host_blocks.extend(host_table)
        self._chains.pop(request.request_id, None)

    # ---- quarantine (remote writes may be in flight) -----------------------------------------------
    def quarantine(self, request: Request, num_head_blocks: int, key: str, until: float) -> None:
        """Take the request's blocks from table index `num_head_blocks` on out of its table and hold them
        under `key` until `until` (time.monotonic()); the head (its own prefix-cache hit, which no peer
        writes into) is freed now. The request id is free for a new block table at once."""
        if key in self._quarantined:
            raise ValueError(f"quarantine key {key} is in use")
        table = self._tables.pop(request.request_id, None) or []
        self._chains.pop(request.request_id, None)
        self.pool.free_blocks(table[:num_head_blocks])
        self._quarantined[key] = (until, table[num_head_blocks:])

    def release_expired_quarantine(self, now: float) -> int:
        """Free the quarantined blocks whose time has come; returns how many blocks were freed."""
        expired = [key for key, (until, _) in self._quarantined.items() if until <= now]
        num_freed = 0
        for key in expired:
            _, blocks = self._quarantined.pop(key)
            self.pool.free_blocks(blocks)
            num_freed += len(blocks)
        return num_freed

    def next_quarantine_release(self) -> float | None:
        return min((until for until, _ in self._quarantined.values()), default=None)

    # ---- swap preemption -----------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[BlockCopy] | None:
        """Move the request's blocks to host slots: returns (device -> host) copies and frees the device
        blocks, or None with nothing changed when host slots are short."""
        table = self._tables.get(request.request_id)
        if table is None:
            raise ValueError(f"request {request.request_id} holds no device blocks")
        if len(table) > len(self._free_host_blocks):
            return None
        host_table = [self._free_host_blocks.popleft() for _ in table]
        self._host_tables[request.request_id] = host_table
        del self._tables[request.request_id]
        self.pool.free_blocks(table)
        return [BlockCopy(src=device, dst=host) for device, host in zip(table, host_table)]

    def swap_in(self, request: Request) -> list[BlockCopy] | None:
        """Bring a swapped-out request back: returns (host -> device) copies, or None with nothing
        changed when device blocks are short. Swapped-in blocks are private (not published)."""
        host_table = self._host_tables.get(request.request_id)
        if host_table is None:
            raise ValueError(f"request {request.request_id} is not swapped out")
        if len(host_table) > self.pool.num_free_blocks:
            return None
        table = self.pool.allocate_many(len(host_table))
        self._tables[request.request_id] = table
        del self._host_tables[request.request_id]
        self._free_host_blocks.extend(host_table)
        return [BlockCopy(src=host, dst=device) for host, device in zip(host_table, table)]

    # ---- invariants ----------------------------------------------------------------------------
    def check_integrity(self, live_request_ids: Collection[str] | None = None) -> bool:
        """Raise KVCacheIntegrityError listing every broken invariant; True when all hold. With
        `live_request_ids` (the requests the engine still knows: scheduled or reserved), a device or host
        block table of any other request is reported too: its blocks would never be freed."""
        holders = [0] * self.pool.num_blocks
        problems: list[str] = []
        if live_request_ids is not None:
            problems.extend(self._orphan_problems(live_request_ids))
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                problems.append(f"request {request_id}: a block appears twice in its table {table}")
            for block_id in table:
                holders[block_id] += 1
        for block_id in self._held_copy_sources:
            holders[block_id] += 1
        for key, (_, blocks) in self._quarantined.items():
            for block_id in blocks:
                holders[block_id] += 1
                if self.pool.block_hash(block_id) is not None:
                    problems.append(f"quarantine {key}: block {block_id} is published in the prefix cache")
        problems.extend(self.pool.integrity_problems(holders))
        problems.extend(self._host_problems())
        if problems:
            raise KVCacheIntegrityError("; ".join(problems))
        return True

    def _orphan_problems(self, live_request_ids: Collection[str]) -> list[str]:
        live = set(live_request_ids)
        problems = [f"request {rid}: holds device blocks {table} but is not live"
                    for rid, table in self._tables.items() if rid not in live]
        problems += [f"request {rid}: holds host slots {table} but is not live"
                     for rid, table in self._host_tables.items() if rid not in live]
        return problems

    def _host_problems(self) -> list[str]:
        used = [slot for table in self._host_tables.values() for slot in table]
        free = list(self._free_host_blocks)
        if sorted(used + free) != list(range(self.num_host_blocks)):
            return [f"host slots: used {sorted(used)} + free {sorted(free)} != 0..{self.num_host_blocks - 1}"]
        return []

    # ---- internals -----------------------------------------------------------------------------
    def _hashes_of(self, request: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first `num_blocks` full blocks (memoized per request)."""
        chain = self._chains.get(request.request_id)
        if chain is None or chain.request is not request:
            chain = self._chains[request.request_id] = _HashChain(request)
        num_known = len(chain.hashes)
        if num_known < num_blocks:
            token_ids = request.token_ids_slice(num_known * self.block_size, num_blocks * self.block_size)
            parent_hash = chain.hashes[-1] if chain.hashes else request.cache_root
            chain.hashes.extend(hash_full_blocks(token_ids, self.block_size, request.cache_salt, parent_hash))
        return chain.hashes[:num_blocks]

    def _plan(self, request: Request, computed: ComputedBlocks | None, num_tokens_total: int) -> _Plan:
        table = self._tables.get(request.request_id)
        if table is None:
            computed = computed if computed is not None else ComputedBlocks([], 0)
            self._check_computed(request, computed)
            held = list(computed.block_ids)
            start = computed.num_tokens
            num_revived = sum(1 for block_id in held if self.pool.ref_count(block_id) == 0)
        else:
            if computed is not None:
                raise ValueError(f"request {request.request_id} already has blocks; computed applies once")
            held, start, num_revived = table, request.num_computed_tokens, 0
        num_new_blocks = max(0, _cdiv(num_tokens_total, self.block_size) - len(held))
        copy_index = None
        first_index = start // self.block_size
        if num_tokens_total > start and first_index < len(held) and self._is_immutable(held[first_index]):
            copy_index = first_index
        hit_block_ids = held if table is None else []
        return _Plan(hit_block_ids, start, num_new_blocks, copy_index, num_revived)

    def _extends_in_place(self, table: list[int], start: int, num_tokens_total: int) -> bool:
        """The tokens [start, num_tokens_total) go into blocks the table holds, none of them shared or published
        (no new block, no copy-on-write)."""
        block_size = self.block_size
        if _cdiv(num_tokens_total, block_size) > len(table) or num_tokens_total <= start:
            return False
        return not any(self._is_immutable(table[index])
                       for index in range(start // block_size, _cdiv(num_tokens_total, block_size)))

    def _check_computed(self, request: Request, computed: ComputedBlocks) -> None:
        """A stale hit (blocks evicted since the lookup) would silently serve wrong K/V: refuse it."""
        num_blocks = len(computed.block_ids)
        low, high = (num_blocks - 1) * self.block_size, num_blocks * self.block_size
        if not (low < computed.num_tokens <= high or computed.num_tokens == num_blocks == 0):
            raise ValueError(f"computed.num_tokens {computed.num_tokens} does not match {num_blocks} blocks")
        if computed.num_tokens >= request.num_tokens:
            raise ValueError("a prefix hit must leave at least one token to compute")
        expected = self._hashes_of(request, num_blocks) if num_blocks else []
        for block_id, block_hash in zip(computed.block_ids, expected):
            if self.pool.block_hash(block_id) != block_hash:
                raise ValueError(f"computed block {block_id} no longer holds the request's prefix")

    def _is_immutable(self, block_id: int) -> bool:
        """Shared, or published in the prefix cache: writing into it would corrupt someone else."""
        return self.pool.ref_count(block_id) > 1 or self.pool.block_hash(block_id) is not None

    def _take_blocks(self, request: Request, plan: _Plan) -> list[int]:
        table = self._tables.get(request.request_id)
        if table is None:
            for block_id in plan.hit_block_ids:
                self.pool.touch(block_id)
            table = self._tables[request.request_id] = list(plan.hit_block_ids)
            self._admit(request, plan.start)
        table.extend(self.pool.allocate_many(plan.num_new_blocks))
        return table

    def _admit(self, request: Request, num_cached_tokens: int) -> None:
        request.num_computed_tokens = num_cached_tokens
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = min(num_cached_tokens, request.num_prompt_tokens)
        self.num_prefix_queries_tokens += request.num_tokens
        self.num_prefix_hit_tokens += num_cached_tokens

    def _copy_on_write(self, table: list[int], copy_index: int | None) -> list[BlockCopy]:
        if copy_index is None:
            return []
        old_block = table[copy_index]
        new_block = self.pool.allocate()
        table[copy_index] = new_block
        # The old block stays published (others may hit it); at end_step it goes back to the cached LRU.
        self._held_copy_sources.append(old_block)
        return [BlockCopy(src=old_block, dst=new_block)]

    def _cache_full_blocks(self, request: Request, table: list[int], start: int, end: int) -> None:
        """Publish the blocks that this step's tokens fill. Their tokens are known now, and a step writes
        all new K/V before attention reads it, so a request scheduled later in this step may share them."""
        if not self.enable_prefix_caching:
            return
        first_index, stop_index = start // self.block_size, end // self.block_size
        if stop_index <= first_index:
            return
        hashes = self._hashes_of(request, stop_index)
        for index in range(first_index, stop_index):
            if self.pool.cache_block(table[index], hashes[index]):
                self._pending.add(table[index])
