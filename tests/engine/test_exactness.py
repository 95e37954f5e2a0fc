"""Greedy output of the engine equals transformers' generate on the same checkpoint, token for token,
under every scheduling situation that changes how K/V get computed and read."""

from __future__ import annotations

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.request import Priority
from flotilla.engine.sampling_params import SamplingParams


def _engine(reference, **overrides) -> LLMEngine:
    settings = dict(model_dir=reference.model_dir, num_kv_blocks=1024, block_size=16)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _run_all(engine: LLMEngine, reference) -> list[list[int]]:
    results = engine.generate(reference.prompts, [_greedy(n) for n in reference.max_tokens])
    return [r.token_ids for r in results]


def _assert_all_free(engine: LLMEngine) -> None:
    assert engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_reference_depends_on_context(reference):
    # Guard against a degenerate model: if every prompt produced the same text the test would prove little.
    assert len({tuple(e) for e in reference.expected}) > len(reference.expected) // 2


def test_concurrent_prompts_match_transformers(reference):
    engine = _engine(reference)
    assert _run_all(engine, reference) == reference.expected
    _assert_all_free(engine)


def test_chunked_prefill_matches_transformers(reference):
    engine = _engine(reference, max_num_batched_tokens=48)  # 600-token prompts need 13 chunks
    assert _run_all(engine, reference) == reference.expected
    _assert_all_free(engine)


def test_prefix_hits_match_transformers(reference):
    engine = _engine(reference)
    _run_all(engine, reference)
    hits_before = engine.stats().prefix_hit_rate
    # Second pass: every prompt is now cached (full hits recompute only the last token).
    results = engine.generate(reference.prompts, [_greedy(n) for n in reference.max_tokens])
    assert [r.token_ids for r in results] == reference.expected
    assert all(r.num_cached_prompt_tokens >= (len(p) // 16 - 1) * 16 for r, p in zip(results, reference.prompts))
    assert engine.stats().prefix_hit_rate > hits_before
    _assert_all_free(engine)


def test_shared_system_prompt_hits_within_one_run(reference):
    engine = _engine(reference)
    results = engine.generate(reference.prompts, [_greedy(n) for n in reference.max_tokens])
    # Prompts 8.. share a 64-token system prompt: all but the first to be admitted hit 4 cached blocks.
    assert sum(r.num_cached_prompt_tokens >= 64 for r in results[8:]) >= 6


def test_preemption_matches_transformers(reference):
    # 60 blocks of 16 = 960 tokens for prompts totalling ~4.5k tokens: requests must be preempted.
    engine = _engine(reference, num_kv_blocks=60, max_num_batched_tokens=256)
    assert _run_all(engine, reference) == reference.expected
    assert engine.stats().num_preemptions > 0
    _assert_all_free(engine)


def test_swap_preemption_matches_transformers(reference):
    engine = _engine(reference, num_kv_blocks=60, max_num_batched_tokens=256, preemption_mode="swap", num_host_kv_blocks=200)
    assert _run_all(engine, reference) == reference.expected
    assert engine.stats().num_preemptions > 0
    _assert_all_free(engine)


def test_requests_added_mid_decode_match_transformers(reference):
    engine = _engine(reference, max_num_batched_tokens=512)
    outputs: dict[str, list[int]] = {}
    pending = list(range(len(reference.prompts)))
    done: set[str] = set()

    def add(i: int) -> None:
        engine.add_request(NewRequest(f"r{i}", tuple(reference.prompts[i]), _greedy(reference.max_tokens[i])))
        outputs[f"r{i}"] = []

    for i in pending[:4]:
        add(i)
    later = pending[4:]
    while len(done) < len(reference.prompts):
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids
            if output.finished:
                done.add(output.request_id)
        if later and any(outputs[k] for k in outputs):  # someone is decoding: add the next one
            add(later.pop(0))
    assert [outputs[f"r{i}"] for i in range(len(reference.prompts))] == reference.expected
    _assert_all_free(engine)


def test_batch_held_back_for_interactive_prefills_matches_transformers(reference):
    # Batch-class and interactive requests arriving mid-decode in 60 blocks: batch sequences sit out interactive
    # prefills (hold_batch, on by default) and are preempted for them; every output is still transformers' own.
    engine = _engine(reference, num_kv_blocks=60, max_num_batched_tokens=256)
    outputs: dict[str, list[int]] = {}
    later = list(range(len(reference.prompts)))
    while later or engine.has_unfinished_requests():
        if later and (not outputs or any(outputs.values())):
            i = later.pop(0)
            priority = Priority.BATCH if i % 2 == 0 else Priority.INTERACTIVE
            engine.add_request(NewRequest(f"r{i}", tuple(reference.prompts[i]), _greedy(reference.max_tokens[i]),
                                          priority=priority))
            outputs[f"r{i}"] = []
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids
    assert [outputs[f"r{i}"] for i in range(len(reference.prompts))] == reference.expected
    assert engine.scheduler.num_held_steps > 0 and engine.stats().num_preemptions > 0
    _assert_all_free(engine)


@pytest.mark.parametrize("block_size", [1, 7])
def test_odd_block_sizes_match_transformers(reference, block_size):
    engine = _engine(reference, block_size=block_size, num_kv_blocks=8192, max_num_batched_tokens=300)
    assert _run_all(engine, reference)[:10] == reference.expected[:10]


def test_the_cpu_default_block_size_matches_transformers(reference):
    """No block size given: a CPU engine pages 128-token blocks (config.DEFAULT_BLOCK_SIZE), exact all the same."""
    engine = _engine(reference, block_size=None, num_kv_blocks=512)
    assert engine.block_size == 128 and engine.runner.kv_caches[0].shape[3] == 128
    assert _run_all(engine, reference) == reference.expected
    _assert_all_free(engine)
