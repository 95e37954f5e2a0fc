"""Scheduler: the one rule under a token budget, admission by projected KV, priority, preemption
(recompute and swap), abort, and a seeded random run checked against a fake K/V store."""

import random

import pytest

from flotilla.engine.errors import ContextLengthError, InvalidRequestError
from flotilla.engine.kv_cache_manager import KVCacheIntegrityError, KVCacheManager
from flotilla.engine.request import FinishReason, Priority, Request, RequestStatus
from flotilla.engine.sampling_params import SamplingParams
from flotilla.engine.scheduler import Scheduler, SchedulerConfig
from flotilla.engine.scheduler_output import BlockCopy, ModelRunnerOutput, SchedulerOutput


class FakeRunner:
    """Stands in for the model runner: stores (salt, token) per K/V slot, applies copies in the real
    runner's order (swap_out, swap_in, block_copies), writes each chunk, then checks every scheduled
    request reads its own tokens back through its block table. Wrong block ids, a stale or cross-tenant
    prefix hit, or a missed copy shows up as a mismatch."""

    def __init__(self, kv: KVCacheManager, rng: random.Random | None = None, vocab: int = 1000):
        self.kv = kv
        self.block_size = kv.block_size
        self.rng = rng
        self.vocab = vocab
        self.device: dict[tuple[int, int], tuple[str, int]] = {}
        self.host: dict[tuple[int, int], tuple[str, int]] = {}

    def execute(self, output: SchedulerOutput, previous: ModelRunnerOutput | None = None) -> ModelRunnerOutput:
        """previous: the output of the step before when it is still "running" (overlap order): a PLACEHOLDER
        token is its sampled token, as the real runner reads it on the device."""
        self.previous = previous
        for copy in output.swap_out:
            self._copy(self.device, self.host, copy)
        for copy in output.swap_in:
            self._copy(self.host, self.device, copy)
        for copy in output.block_copies:
            self._copy(self.device, self.device, copy)
        for chunk in output.chunks:
            self._check_writable(chunk)
            tokens = self._tokens(chunk.request)
            for position in range(chunk.start, chunk.end):
                self.device[self._slot(chunk.block_ids, position)] = (chunk.request.cache_salt, tokens[position])
        for chunk in output.chunks:
            self._check_reads(chunk)
        return ModelRunnerOutput(
            {c.request.request_id: self._sample(c.request) for c in output.chunks if c.samples}
        )

    def _check_writable(self, chunk) -> None:
        """Copy-on-write: a step writes only private blocks, or blocks published in this very step
        (whose writer is this step; a same-step sharer only reads them)."""
        first, last = chunk.start // self.block_size, (chunk.end - 1) // self.block_size
        for block_id in chunk.block_ids[first : last + 1]:
            pool = self.kv.pool
            shared = pool.ref_count(block_id) > 1 or pool.block_hash(block_id) is not None
            assert not shared or block_id in self.kv._pending, f"{chunk.request.request_id} writes shared {block_id}"

    def _tokens(self, request: Request) -> list[int]:
        tokens = request.all_token_ids
        if request.awaits_token:
            assert self.previous is not None, f"{request.request_id}: a placeholder with no step running"
            tokens[-1] = self.previous.sampled_token_ids[request.request_id]
        return tokens

    def _check_reads(self, chunk) -> None:
        assert len(chunk.block_ids) * self.block_size >= chunk.end
        tokens = self._tokens(chunk.request)
        for position in range(chunk.end):
            got = self.device.get(self._slot(chunk.block_ids, position))
            expected = (chunk.request.cache_salt, tokens[position])
            assert got == expected, f"{chunk.request.request_id} position {position}: {got} != {expected}"

    def _slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        return block_ids[position // self.block_size], position % self.block_size

    def _copy(self, source: dict, target: dict, copy: BlockCopy) -> None:
        for offset in range(self.block_size):
            value = source.get((copy.src, offset))
            if value is None:
                target.pop((copy.dst, offset), None)
            else:
                target[(copy.dst, offset)] = value

    def _sample(self, request: Request) -> int:
        if self.rng is not None:
            return self.rng.randrange(self.vocab)
        return 1000 + request.num_tokens  # deterministic and distinct per position


def _request(request_id, tokens, max_tokens=8, priority=Priority.INTERACTIVE, salt="", arrival_time=None):
    extra = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(
        request_id, list(tokens), SamplingParams(max_tokens=max_tokens), priority=priority, cache_salt=salt, **extra
    )


def _scheduler(num_blocks=20, block_size=4, num_host_blocks=0, **config):
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    return Scheduler(SchedulerConfig(**config), kv), FakeRunner(kv)


def _step(scheduler: Scheduler, runner: FakeRunner, samples: list | None = None) -> SchedulerOutput:
    """One engine-loop turn: schedule, run, update, finish requests that reached max_tokens.
    `samples` collects each chunk's `samples` flag, read before update (it is a live property)."""
    output = scheduler.schedule()
    if samples is not None:
        samples.append([c.samples for c in output.chunks])
    scheduler.update_from_output(output, runner.execute(output))
    for chunk in output.chunks:
        request = chunk.request
        if request.request_id in scheduler.requests and request.num_output_tokens >= request.sampling_params.max_tokens:
            scheduler.finish_request(request.request_id, FinishReason.LENGTH)
    return output


def _chunks(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in output.chunks]


# ---- the one rule and the budget -----------------------------------------------------------------
def test_long_prompt_is_chunked_and_never_stalls_decode():
    scheduler, runner = _scheduler(max_num_batched_tokens=8)
    scheduler.add_request(_request("a", [1, 2, 3], max_tokens=10))
    assert _chunks(_step(scheduler, runner)) == [("a", 0, 3)]
    scheduler.add_request(_request("b", range(100, 120)))
    outputs, samples = [], []
    for _ in range(3):
        outputs.append(_step(scheduler, runner, samples))
    assert [_chunks(o) for o in outputs] == [
        [("a", 3, 1), ("b", 0, 7)],
        [("a", 4, 1), ("b", 7, 7)],
        [("a", 5, 1), ("b", 14, 6)],
    ]
    assert samples == [[True, False], [True, False], [True, True]]
    assert outputs[0].num_scheduled_tokens == 8
    assert scheduler.last_num_scheduled_tokens == 7
    assert scheduler.requests["b"].output_token_ids == [1020]
    assert outputs[2].chunks[1].block_ids == [1, 2, 4, 5, 6]  # block 3 went to a (running first)


def test_two_requests_sharing_a_prefix_in_one_step():
    # Regression (nano-vllm): the second request must hit the blocks the first computes in this step.
    scheduler, runner = _scheduler(max_num_batched_tokens=64)
    scheduler.add_request(_request("a", range(10)))
    scheduler.add_request(_request("b", [0, 1, 2, 3, 4, 5, 6, 7, 50, 51]))
    output = _step(scheduler, runner)
    assert _chunks(output) == [("a", 0, 10), ("b", 8, 2)]
    assert [c.block_ids for c in output.chunks] == [[0, 1, 2], [0, 1, 3]]
    assert output.block_copies == []
    assert scheduler.requests["b"].num_cached_prompt_tokens == 8


def test_identical_prompts_in_one_step_recompute_the_unwritten_last_block():
    scheduler, runner = _scheduler(max_num_batched_tokens=64)
    scheduler.add_request(_request("a", range(8)))
    scheduler.add_request(_request("b", range(8)))
    output = _step(scheduler, runner)
    assert _chunks(output) == [("a", 0, 8), ("b", 4, 4)]
    assert [c.block_ids for c in output.chunks] == [[0, 1], [0, 2]]
    assert output.block_copies == []


def test_fully_cached_prompt_recomputes_last_token_with_a_copy():
    scheduler, runner = _scheduler(max_num_batched_tokens=64)
    scheduler.add_request(_request("a", range(8), max_tokens=1))
    _step(scheduler, runner)
    assert not scheduler.has_unfinished_requests
    b = _request("b", range(8), max_tokens=1)
    scheduler.add_request(b)
    samples = []
    output = _step(scheduler, runner, samples)
    assert _chunks(output) == [("b", 7, 1)] and samples == [[True]]
    assert output.block_copies == [BlockCopy(src=1, dst=2)]  # token 7 goes into a private copy
    assert output.chunks[0].block_ids == [0, 2]
    assert b.output_token_ids == [1008] and b.is_finished
    # Drained: the held copy source was released by update_from_output, no further schedule() needed.
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


# ---- admission ------------------------------------------------------------------------------------
def test_admission_refused_when_projected_blocks_do_not_fit():
    scheduler, runner = _scheduler(num_blocks=6, max_num_batched_tokens=64, num_lookahead_steps=4)
    scheduler.add_request(_request("a", range(12), max_tokens=4))
    scheduler.add_request(_request("b", range(100, 109), max_tokens=8))  # 9 + 4 growth -> 4 blocks
    scheduler.add_request(_request("c", [7], max_tokens=1))  # would fit, but waits behind b
    output = _step(scheduler, runner)
    assert _chunks(output) == [("a", 0, 12)]
    assert scheduler.kv.num_free_blocks == 3
    assert scheduler.num_waiting == 2
    while scheduler.requests.get("a"):
        _step(scheduler, runner)
    assert _chunks(_step(scheduler, runner)) == [("b", 0, 9), ("c", 0, 1)]


def test_projected_growth_is_capped_by_max_tokens():
    scheduler, runner = _scheduler(num_blocks=6, max_num_batched_tokens=64, num_lookahead_steps=4)
    scheduler.add_request(_request("a", range(12), max_tokens=4))
    scheduler.add_request(_request("b", range(100, 109), max_tokens=3))  # at most 12 tokens: 3 blocks
    assert _chunks(_step(scheduler, runner)) == [("a", 0, 12), ("b", 0, 9)]


def test_max_num_seqs_limits_running_requests():
    scheduler, runner = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        scheduler.add_request(_request(name, [ord(name)]))
    assert [c[0] for c in _chunks(_step(scheduler, runner))] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)


# ---- priority and preemption ---------------------------------------------------------------------
def test_interactive_admitted_before_batch():
    scheduler, runner = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler.add_request(_request("batch1", [1], max_tokens=1, priority=Priority.BATCH))
    scheduler.add_request(_request("inter1", [2], max_tokens=1))
    scheduler.add_request(_request("batch2", [3], max_tokens=1, priority=Priority.BATCH))
    scheduler.add_request(_request("inter2", [4], max_tokens=1))
    assert [c[0] for c in _chunks(_step(scheduler, runner))] == ["inter1", "inter2"]
    assert [c[0] for c in _chunks(_step(scheduler, runner))] == ["batch1", "batch2"]


def test_victim_is_lowest_priority_then_newest():
    # Without hold_batch, so that b1 runs beside the interactive prefills (test_batch_hold.py: with it).
    scheduler, runner = _scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=64, num_lookahead_steps=0,
                                   hold_batch=False)
    scheduler.add_request(_request("i1", [1, 1], max_tokens=6))
    scheduler.add_request(_request("b1", [2, 2], max_tokens=6, priority=Priority.BATCH))
    scheduler.add_request(_request("i2", [3, 3], max_tokens=6))
    first = _step(scheduler, runner)
    assert [(c.request.request_id, c.block_ids) for c in first.chunks] == [("i1", [0]), ("i2", [1]), ("b1", [2])]
    second = _step(scheduler, runner)  # everyone needs a second block, one is free
    assert [r.request_id for r in second.preempted] == ["b1"]  # older than i2, but lower priority
    assert [(c.request.request_id, c.block_ids) for c in second.chunks] == [("i1", [0, 3]), ("i2", [1, 2])]
    b1 = scheduler.requests["b1"]
    assert (b1.status, b1.num_computed_tokens, b1.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b1.output_token_ids == [1002]  # outputs survive: the recompute prefill covers them
    _step(scheduler, runner)  # tokens 3 fit; b1 (3 tokens -> 2 blocks) cannot be admitted
    fourth = _step(scheduler, runner)
    assert [r.request_id for r in fourth.preempted] == ["i2"]  # same class: the newest goes
    assert [(c.request.request_id, c.block_ids) for c in fourth.chunks] == [("i1", [0, 3, 2])]


def test_preempt_then_resume_with_recompute():
    # Regression (nano-vllm): a resumed request must recompute prompt + outputs and continue exactly.
    scheduler, runner = _scheduler(num_blocks=3, block_size=4, max_num_seqs=2, num_lookahead_steps=0)
    scheduler.add_request(_request("r1", range(4), max_tokens=2, arrival_time=1.0))
    scheduler.add_request(_request("r2", range(10, 14), max_tokens=4, arrival_time=2.0))
    assert [c.block_ids for c in _step(scheduler, runner).chunks] == [[0], [1]]
    scheduler.add_request(_request("n", [99], max_tokens=1, arrival_time=0.0))  # older, but new
    second = _step(scheduler, runner)  # r1 takes the last block; r2 must preempt itself
    assert [r.request_id for r in second.preempted] == ["r2"]
    assert _chunks(second) == [("r1", 4, 1)]  # r1 finishes; n may not overtake preempted r2 next
    third = _step(scheduler, runner)
    assert _chunks(third) == [("r2", 4, 1), ("n", 0, 1)]  # r2 hits its own cached prompt block
    r2 = scheduler.requests["r2"]
    assert third.chunks[0].block_ids[0] == 1
    assert r2.num_cached_prompt_tokens == 0  # counted at first admission only
    assert scheduler.kv.num_prefix_hit_tokens == 4
    while scheduler.has_unfinished_requests:
        _step(scheduler, runner)
    assert r2.output_token_ids == [1004, 1005, 1006, 1007]
    assert r2.num_preemptions == 1 and r2.finish_reason is FinishReason.LENGTH
    assert scheduler.kv.num_free_blocks == 3 and scheduler.kv.check_integrity()


def test_preempt_then_resume_with_swap():
    scheduler, runner = _scheduler(
        num_blocks=3, block_size=4, num_host_blocks=4, preemption_mode="swap", num_lookahead_steps=0
    )
    scheduler.add_request(_request("r1", range(4), max_tokens=6))
    scheduler.add_request(_request("r2", range(10, 14), max_tokens=2))
    _step(scheduler, runner)
    second = _step(scheduler, runner)
    assert [r.request_id for r in second.preempted] == ["r2"]
    assert second.swap_out == [BlockCopy(src=1, dst=0)]
    r2 = scheduler.requests["r2"]
    assert (r2.status, r2.num_computed_tokens) == (RequestStatus.PREEMPTED, 4)  # K/V kept on the host
    outputs = []
    while "r1" in scheduler.requests:
        outputs.append(_step(scheduler, runner))
    assert all(not o.swap_in for o in outputs)  # r2 waited: its 2 blocks never fit beside r1
    resumed = _step(scheduler, runner)
    assert resumed.swap_in == [BlockCopy(src=0, dst=1)]
    assert _chunks(resumed) == [("r2", 4, 1)]  # no recompute: continues at its next token
    assert resumed.chunks[0].block_ids == [1, 2]
    assert not scheduler.has_unfinished_requests  # r2 reached max_tokens=2
    assert r2.output_token_ids == [1004, 1005]
    assert scheduler.kv.num_free_host_blocks == 4 and scheduler.kv.check_integrity()


# ---- abort and finish ----------------------------------------------------------------------------
def test_abort_frees_blocks_at_once():
    scheduler, runner = _scheduler(num_blocks=10, max_num_seqs=1)
    scheduler.add_request(_request("a", range(9)))
    scheduler.add_request(_request("b", range(20, 29)))
    _step(scheduler, runner)
    assert scheduler.kv.num_free_blocks == 7
    aborted = scheduler.abort_request("a")
    assert aborted.status is RequestStatus.FINISHED and aborted.finish_reason is FinishReason.ABORT
    assert scheduler.kv.num_free_blocks == 10 and scheduler.kv.block_ids("a") == []
    assert scheduler.abort_request("b").finish_reason is FinishReason.ABORT  # from waiting
    assert scheduler.abort_request("b") is None and scheduler.abort_request("zzz") is None
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.has_unfinished_requests) == (0, 0, False)


def test_abort_between_schedule_and_update_is_skipped():
    scheduler, runner = _scheduler()
    scheduler.add_request(_request("a", range(5)))
    scheduler.add_request(_request("b", range(20, 25)))
    output = scheduler.schedule()
    aborted = scheduler.abort_request("a")
    scheduler.add_request(_request("a", [1, 2]))  # same id, a new request
    scheduler.update_from_output(output, runner.execute(output))
    assert aborted.num_computed_tokens == 0 and aborted.output_token_ids == []
    assert scheduler.requests["a"].num_computed_tokens == 0
    assert scheduler.requests["b"].num_computed_tokens == 5
    assert scheduler.kv.check_integrity()


def test_missing_sampled_token_is_an_error():
    scheduler, _ = _scheduler()
    scheduler.add_request(_request("a", [1, 2]))
    output = scheduler.schedule()
    with pytest.raises(RuntimeError, match="no sampled token"):
        scheduler.update_from_output(output, ModelRunnerOutput())


def test_add_request_validation():
    scheduler, _ = _scheduler(num_blocks=4, block_size=4, max_model_len=32)
    scheduler.add_request(_request("a", [1]))
    with pytest.raises(InvalidRequestError, match="request_id"):
        scheduler.add_request(_request("a", [1]))
    with pytest.raises(InvalidRequestError, match="prompt"):
        scheduler.add_request(_request("e", []))
    with pytest.raises(ContextLengthError):
        scheduler.add_request(_request("long", range(30), max_tokens=8))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        scheduler.add_request(_request("big", range(10), max_tokens=10))  # 20 tokens > 16 slots
    assert list(scheduler.requests) == ["a"]


def test_integrity_checked_when_the_engine_drains():
    scheduler, runner = _scheduler()
    scheduler.add_request(_request("a", [1], max_tokens=1))
    _step(scheduler, runner)
    scheduler.kv.pool._ref_counts[3] = 1  # corrupt: a block referenced by no table
    with pytest.raises(KVCacheIntegrityError):
        scheduler.schedule()


def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)


# ---- randomized ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "overlap"), [("recompute", False), ("swap", False), ("recompute", True),
                                               ("swap", True)])
def test_random_operations_keep_invariants_and_drain(mode, overlap):
    """overlap: the engine's overlap order (engine.py, step): each step is scheduled and run while the one before is
    "running" (its tokens still placeholders), then that one's tokens are filled in, its requests finished, and
    the new step advanced."""
    rng = random.Random(20240917 if mode == "recompute" else 7)
    config = SchedulerConfig(
        max_num_batched_tokens=10, max_num_seqs=4, num_lookahead_steps=2, preemption_mode=mode
    )
    kv = KVCacheManager(num_blocks=12, block_size=2, num_host_blocks=6 if mode == "swap" else 0)
    scheduler = Scheduler(config, kv)
    runner = FakeRunner(kv, rng=rng, vocab=3)  # tiny vocab: outputs share prefixes too
    prefixes = [[rng.randrange(3) for _ in range(8)] for _ in range(3)]
    stats = {"finished": 0, "preempted": 0, "swapped": 0, "in_flight": None if overlap else False}
    next_id = 0
    for _ in range(10_000):
        op = rng.random()
        if op < 0.3 and len(scheduler.requests) < 10:
            scheduler.add_request(_random_request(rng, str(next_id), prefixes))
            next_id += 1
        elif op < 0.36 and scheduler.requests:
            scheduler.abort_request(rng.choice(list(scheduler.requests)))
        elif op < 0.38 and scheduler.requests:
            scheduler.finish_request(rng.choice(list(scheduler.requests)), FinishReason.STOP)
        elif op < 0.385:
            kv.reset_prefix_cache()
        else:
            _random_step(scheduler, runner, rng, config, stats)
    for _ in range(2_000):  # drain: every request must finish without outside help
        if not scheduler.has_unfinished_requests:
            break
        _random_step(scheduler, runner, None, config, stats)
    if stats["in_flight"]:
        _finish_step(scheduler, *stats["in_flight"], stats)
    assert not scheduler.has_unfinished_requests
    assert kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    # The run exercised what it claims to: completions, preemptions, prefix hits (and swaps).
    assert stats["finished"] > 300 and stats["preempted"] > 10 and kv.num_prefix_hit_tokens > 100
    assert stats["swapped"] > 5 or mode == "recompute"


def _random_request(rng: random.Random, request_id: str, prefixes: list[list[int]]) -> Request:
    tokens = rng.choice(prefixes)[: rng.randrange(0, 9)] + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
    return _request(
        request_id,
        tokens or [1],
        max_tokens=rng.randrange(1, 7),
        priority=rng.choice(list(Priority)),
        salt=rng.choice(["", "tenant"]),
    )


def _random_step(scheduler, runner, rng, config, stats) -> None:
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == sum(c.num_tokens for c in output.chunks) <= config.max_num_batched_tokens
    assert scheduler.num_running <= config.max_num_seqs
    stats["preempted"] += len(output.preempted)
    stats["swapped"] += len(output.swap_out)
    running = stats["in_flight"]
    model_output = runner.execute(output, running[1] if running else None)
    if rng is not None and output.chunks and rng.random() < 0.05:  # abort while the step "runs"
        scheduler.abort_request(rng.choice(output.chunks).request.request_id)
    if running is False:  # the synchronous order
        scheduler.update_from_output(output, model_output)
        _finish_lengths(scheduler, output, stats)
    else:
        if running is not None:
            _finish_step(scheduler, *running, stats)
            scheduler.publish_filled(output)
        scheduler.advance(output)
        stats["in_flight"] = (output, model_output)
    scheduler.kv.check_integrity()


def _finish_step(scheduler, output, model_output, stats) -> None:
    scheduler.fill_sampled(output, model_output)
    _finish_lengths(scheduler, output, stats)
    stats["in_flight"] = None


def _finish_lengths(scheduler, output, stats) -> None:
    for chunk in output.chunks:
        request = chunk.request
        if request.request_id in scheduler.requests and request.num_output_tokens >= request.sampling_params.max_tokens:
            scheduler.finish_request(request.request_id, FinishReason.LENGTH)
            stats["finished"] += 1
