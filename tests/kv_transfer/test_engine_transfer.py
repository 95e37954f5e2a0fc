"""Engine-level disaggregation: a prefill engine ships KV layer by layer into a decode engine's reserved
blocks (real NIXL between two agents, and the in-process copy transport); the decode engine continues
from the first token. Output must equal a colocated engine's; KV bytes must match per layer."""

from __future__ import annotations

import random

import pytest

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams
from flotilla.kv_transfer.copy_transport import CopyTransport
from flotilla.kv_transfer.nixl_transport import NixlTransport

from .engine_pair import EnginePair, layer_digests

BLOCK_SIZE = 16


def _engine(checkpoint, **overrides) -> LLMEngine:
    settings = dict(model_dir=str(checkpoint), num_kv_blocks=256, block_size=BLOCK_SIZE, max_num_batched_tokens=64)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _prompts(seed: int, lengths: list[int], vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> LLMEngine:
    return _engine(tiny_checkpoint)


@pytest.mark.parametrize("transport_cls", [NixlTransport, CopyTransport])
def test_remote_prefill_matches_colocated_and_kv_bytes(tiny_checkpoint, reference, transport_cls):
    pair = EnginePair.build(_engine(tiny_checkpoint), _engine(tiny_checkpoint), transport_cls)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        # 150 tokens with a 64-token budget: three chunks, the last block partial; 33: one chunk, one token over.
        for i, prompt in enumerate(_prompts(1, [150, 33, 16])):
            request_id = f"r{i}"
            reservation, first = pair.prefill_remotely(request_id, prompt, params)
            source_blocks = pair.prefill.kv_cache_manager.block_ids(request_id)
            dst_blocks = pair.decode.kv_cache_manager.block_ids(request_id)
            assert layer_digests(pair.decode, dst_blocks, len(prompt)) == layer_digests(
                pair.prefill, source_blocks, len(prompt)
            )
            pair.prefill.abort(request_id)
            tokens = [pair.decode.add_prefilled_request(reservation.request, first).new_token_ids[0]]
            while pair.decode.has_unfinished_requests():
                tokens += [t for out in pair.decode.step() for t in out.new_token_ids]
            expected = reference.generate([prompt], params)[0].token_ids
            assert tokens == expected
        assert pair.decode.check_integrity() and pair.prefill.check_integrity()
        assert pair.decode.kv_cache_manager.num_free_blocks == 256
    finally:
        pair.close()


def test_decode_prefix_hit_ships_only_missing_blocks(tiny_checkpoint, reference):
    pair = EnginePair.build(_engine(tiny_checkpoint), _engine(tiny_checkpoint), CopyTransport)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        shared = _prompts(2, [64])[0]
        first_prompt, second_prompt = shared + _prompts(3, [20])[0], shared + _prompts(4, [40])[0]
        pair.decode.generate([first_prompt], params)  # the decode side caches the shared 64 tokens
        reservation, first = pair.prefill_remotely("b", second_prompt, params)
        assert reservation.first_block_index == 4 and reservation.num_cached_tokens == 64
        assert len(reservation.dst_block_ids) == 3  # 104 tokens = 7 blocks, 4 of them cached
        pair.prefill.abort("b")
        tokens = [pair.decode.add_prefilled_request(reservation.request, first).new_token_ids[0]]
        while pair.decode.has_unfinished_requests():
            tokens += [t for out in pair.decode.step() for t in out.new_token_ids]
        assert tokens == reference.generate([second_prompt], params)[0].token_ids
        assert pair.decode.check_integrity()
    finally:
        pair.close()
