"""Decode-graph logic on a CPU: captured sizes, padding to the next size, the static inputs a step writes, and a
whole engine on the Triton backend (Triton's interpreter) whose decode steps go through the static buffers, greedy
token for token equal to the default CPU engine. The capture itself needs CUDA (loadtest/gpu_check.py)."""

import os

import pytest
import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.cuda_graphs import DecodeRow, bucket_for, capture_sizes, padded_inputs
from flotilla.engine.engine import LLMEngine
from flotilla.engine.sampling_params import SamplingParams


def test_capture_sizes_cover_every_batch_with_little_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[-1] == 256 and len(sizes) == 35
    for batch in range(1, 257):
        bucket = bucket_for(batch, sizes)
        assert bucket >= batch and bucket - batch < 8
    assert bucket_for(257, sizes) is None
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_inputs_point_padding_at_the_spare_slot():
    rows = [DecodeRow(7, 5, [3, 9]), DecodeRow(8, 0, [4]), DecodeRow(9, 8, [1, 2, 6, 0])]
    host = padded_inputs(rows, bucket=4, width=8, block_size=4, pad_slot=40)
    assert host["input_ids"].tolist() == [7, 8, 9, 0]
    assert host["positions"].tolist() == [5, 0, 8, 0]
    assert host["slot_mapping"].tolist() == [9 * 4 + 1, 4 * 4 + 0, 6 * 4 + 0, 40]
    assert host["context_lens"].tolist() == [6, 1, 9, 0]  # the padding row reads nothing
    # only the blocks each context needs, as wide as the longest row needs
    assert host["block_tables"].tolist() == [[3, 9, 0], [4, 0, 0], [1, 2, 6], [0, 0, 0]]


def test_padded_inputs_reject_what_does_not_fit():
    with pytest.raises(ValueError, match="bucket"):
        padded_inputs([DecodeRow(1, 0, [0])] * 3, bucket=2, width=4, block_size=4, pad_slot=0)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        padded_inputs([DecodeRow(1, 9, [0, 1])], bucket=1, width=4, block_size=4, pad_slot=0)
    with pytest.raises(ValueError, match="table width 2"):
        padded_inputs([DecodeRow(1, 9, [0, 1, 2])], bucket=1, width=2, block_size=4, pad_slot=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
@pytest.mark.parametrize(("split_decode", "overlap"), [(False, False), (True, False), (False, True)])
def test_triton_engine_with_decode_graph_buffers_matches_cpu_engine(tiny_checkpoint, monkeypatch, split_decode,
                                                                    overlap):
    """Prompts chunked over mixed prefill/decode steps (8 tokens a step), decode steps through the static buffers
    padded to a captured size, then a prefix hit; greedy tokens equal to the CPU engine's. split_decode: as on a
    GPU with 64 multiprocessors and 8-key splits, so that the graph buffers' decode steps split their keys.
    overlap: overlap_output_processing, as on a GPU: decode rows whose token is still a placeholder read it from the
    previous step's ids into the static buffers. (The interpreter takes ~0.2 s a kernel launch: few steps.)"""
    pytest.importorskip("triton")
    from flotilla.engine.model import triton_attention

    splits = []
    if split_decode:
        monkeypatch.setattr(triton_attention, "_num_multiprocessors", lambda device: 64)
        monkeypatch.setattr(triton_attention, "MIN_SPLIT_KEYS", 8)
        decode_splits = triton_attention.decode_splits
        monkeypatch.setattr(triton_attention, "decode_splits", lambda *a: splits.append(decode_splits(*a)) or splits[-1])
    prompts = [[5 + i, 17, 3 * i + 1] * (i + 1) for i in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    config = dict(model_dir=str(tiny_checkpoint), device="cpu", num_kv_blocks=32, block_size=4, max_model_len=64,
                  max_num_batched_tokens=8)
    expected = [r.token_ids for r in LLMEngine(EngineConfig(**config)).generate(prompts, params)]
    monkeypatch.setattr(LLMEngine, "_graph_sizes", lambda self, model: [1, 4])
    engine = LLMEngine(EngineConfig(**config, attention_backend="triton", overlap_output_processing=overlap))
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 4]
    assert engine.runner.kv_caches[0].shape[1] == 33  # the spare block the padding writes into
    replays = []
    run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda rows, held=None: replays.append((len(rows), held is not None)) or run(rows, held)
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert replays and any(size not in (1, 4) for size, _ in replays)  # at least one step was padded
    assert any(held for _, held in replays) == overlap  # placeholders written into the buffers on the device
    [again] = engine.generate([prompts[2]], params)
    assert again.token_ids == expected[2] and again.num_cached_prompt_tokens == 8
    assert (max(splits, default=1) > 1) == split_decode  # 64 keys the tables hold, 8 a split: 8 splits


def test_config_rejects_unknown_backends_and_kv_types(tiny_checkpoint):
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir="x", attention_backend="cudnn").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model_dir="x", kv_cache_dtype="int4").validate()


def test_fp8_kv_cache_on_the_torch_path(tiny_checkpoint):
    """fp8 KV: half the bytes per block, and a greedy run that still completes (accuracy: the device check)."""
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_checkpoint), device="cpu", num_kv_blocks=16,
                                    kv_cache_dtype="float8_e4m3fn"))
    assert engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn and not engine.runner.use_decode_kernel
    [result] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(result.token_ids) == 3


def test_a_failed_capture_stops_start_up_naming_the_way_around_it(tiny_checkpoint, monkeypatch):
    """A capture that fails (an op that synchronises inside it, the graph pool out of memory) is not papered over
    with eager steps on a half-captured pool: start-up stops, saying which size failed and the flag to use."""
    pytest.importorskip("triton")
    from flotilla.engine import cuda_graphs

    build = cuda_graphs.DecodeGraphs._build

    def capture_fails_at_four(graphs, size):
        if size == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return build(graphs, size)

    monkeypatch.setattr(LLMEngine, "_graph_sizes", lambda self, model: [1, 4, 8])
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_build", capture_fails_at_four)
    config = EngineConfig(model_dir=str(tiny_checkpoint), device="cpu", num_kv_blocks=32, block_size=4,
                          max_model_len=64, attention_backend="triton")
    with pytest.raises(cuda_graphs.GraphCaptureError, match="batch size 4 failed .*not permitted.*--no-cuda-graphs"):
        LLMEngine(config)
