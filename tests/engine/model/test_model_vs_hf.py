"""Our paged model against transformers on the same random checkpoints."""

import pytest
import torch

from flotilla.engine.model import load_model
from tests.support.kernels import needs_kernels

from .helpers import KINDS, PagedDriver, hf_greedy, hf_logits, random_tokens

ATOL = 1e-4
# Multi-token chunks through SDPA over gathered blocks, or through the CPU prefill kernel reading them in place.
PREFILL_PATHS = [False, pytest.param(True, marks=needs_kernels)]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("use_prefill_kernel", PREFILL_PATHS)
def test_one_chunk_prefill_matches_hf(checkpoint_factory, kind, use_prefill_kernel):
    ckpt = checkpoint_factory(kind)
    tokens = random_tokens(37, seed=1)
    ours = PagedDriver(ckpt.model, use_prefill_kernel=use_prefill_kernel).all_logits("a", tokens)
    torch.testing.assert_close(ours, hf_logits(ckpt.hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama_gqa", "llama3_rope", "qwen2_tied"])
@pytest.mark.parametrize("chunk_sizes", [(5, 3, 9, 1), (8, 8, 2), (13,)])
@pytest.mark.parametrize("use_prefill_kernel", PREFILL_PATHS)
def test_chunked_prefill_then_decode_matches_hf(checkpoint_factory, kind, chunk_sizes, use_prefill_kernel):
    ckpt = checkpoint_factory(kind)
    tokens = random_tokens(sum(chunk_sizes) + 6, seed=2)
    reference = hf_logits(ckpt.hf, tokens)
    driver = PagedDriver(ckpt.model, block_size=4, seed=len(chunk_sizes), use_prefill_kernel=use_prefill_kernel)
    start = 0
    for size in chunk_sizes:  # chunk ends cross block boundaries (block_size 4)
        (logits,) = driver.step([("a", tokens, start, size)])
        start += size
        torch.testing.assert_close(logits, reference[start - 1], atol=ATOL, rtol=0)
    while start < len(tokens):
        (logits,) = driver.step([("a", tokens, start, 1)])
        start += 1
        torch.testing.assert_close(logits, reference[start - 1], atol=ATOL, rtol=0)
    assert driver.tables["a"] != sorted(driver.tables["a"])  # really a shuffled block table


@pytest.mark.parametrize("use_prefill_kernel", PREFILL_PATHS)
def test_mixed_step_matches_each_sequence_alone(checkpoint_factory, use_prefill_kernel):
    ckpt = checkpoint_factory("llama_gqa")
    lengths = {"a": 11, "b": 6, "c": 23, "d": 9}
    seqs = {name: random_tokens(n, seed=10 + i) for i, (name, n) in enumerate(lengths.items())}
    reference = {name: hf_logits(ckpt.hf, tokens) for name, tokens in seqs.items()}
    driver = PagedDriver(ckpt.model, block_size=4, seed=3, use_prefill_kernel=use_prefill_kernel)
    driver.step([("a", seqs["a"], 0, 10), ("b", seqs["b"], 0, 5), ("c", seqs["c"], 0, 7)])
    # decode a, prefill chunk of c from an offset, new prefill d, decode b after them (out of order)
    work = [("a", seqs["a"], 10, 1), ("c", seqs["c"], 7, 16), ("d", seqs["d"], 0, 9), ("b", seqs["b"], 5, 1)]
    logits = driver.step(work)
    for row, (name, tokens, start, n) in enumerate(work):
        torch.testing.assert_close(logits[row], reference[name][start + n - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("use_prefill_kernel", PREFILL_PATHS)
def test_sequence_reads_blocks_written_by_another_in_the_same_step(checkpoint_factory, use_prefill_kernel):
    ckpt = checkpoint_factory("llama_gqa")
    prefix = random_tokens(8, seed=20)
    second = prefix + random_tokens(3, seed=21)
    driver = PagedDriver(ckpt.model, block_size=4, seed=4, use_prefill_kernel=use_prefill_kernel)
    first_chunk = driver.chunk("first", 0, 8)
    # "second" shares the two prefix blocks that "first" fills in this very step
    driver.tables["second"] = list(first_chunk.block_ids)
    second_chunk = driver.chunk("second", 8, 3)
    logits = driver.run([first_chunk, second_chunk], [prefix, second[8:]])
    torch.testing.assert_close(logits[0], hf_logits(ckpt.hf, prefix)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(ckpt.hf, second)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_tied", "llama3_rope"])
def test_greedy_generation_equals_hf_generate(checkpoint_factory, kind):
    ckpt = checkpoint_factory(kind)
    prompt = random_tokens(9, seed=30)
    num_new = 30
    expected = hf_greedy(ckpt.hf, prompt, num_new)
    driver = PagedDriver(ckpt.model, block_size=4, seed=5)
    tokens = list(prompt)
    (logits,) = driver.step([("a", tokens, 0, len(tokens))])
    while len(tokens) < len(prompt) + num_new:
        tokens.append(int(logits.argmax()))
        (logits,) = driver.step([("a", tokens, len(tokens) - 1, 1)])
    assert tokens == expected
    assert len(set(tokens[len(prompt):])) > 3  # the model does not just repeat one token


def test_bfloat16_runs_and_is_close_to_float32(checkpoint_factory):
    ckpt = checkpoint_factory("llama_gqa")
    model_bf16 = load_model(ckpt.directory, torch.bfloat16, torch.device("cpu"))
    assert next(model_bf16.parameters()).dtype == torch.bfloat16
    tokens = random_tokens(20, seed=40)
    outputs = []
    for model in (ckpt.model, model_bf16):
        driver = PagedDriver(model, block_size=4, seed=6)
        (prefill,) = driver.step([("a", tokens, 0, 17)])
        decodes = [driver.step([("a", tokens, i, 1)])[0] for i in range(17, 20)]
        outputs.append(torch.stack([prefill, *decodes]))
    float32, bfloat16 = outputs
    assert bfloat16.dtype == torch.float32
    scale = float32.abs().max()
    assert (bfloat16 - float32).abs().max() < 0.05 * scale
    cosine = torch.nn.functional.cosine_similarity(bfloat16, float32, dim=-1)
    assert cosine.min() > 0.999
