"""The layouts beyond plain Llama/Qwen2 against transformers, each on a random checkpoint of its own config:
prefill logits, chunked prefill then decode through the paged KV cache (the SDPA path and the CPU decode kernel
the engine uses), greedy decode, and the engine itself (scheduler, ModelRunner) against `generate`.

Sliding windows are 8 keys and the sequences run to 40 or more, so each window really hides keys (a test below
checks that the output changes without the mask or the soft-cap); dynamic NTK and LongRoPE change frequencies
past position 32, which the sequences cross in prefill and in decode."""

import pytest
import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.engine import LLMEngine
from flotilla.engine.new_request import NewRequest
from flotilla.engine.model import load_model
from flotilla.engine.sampling_params import SamplingParams
from tests.support.kernels import kernels_cannot_build, needs_kernels

from .helpers import (PagedDriver, add_tokenizer, hf_chunked_logits, hf_greedy, hf_greedy_logprobs, hf_logits,
                      random_tokens)

ATOL = 1e-4
KINDS = ["qwen3", "phi3", "phi3_longrope", "qwen3_moe", "mistral", "qwen2_window", "gemma2", "gemma3", "llama_yarn",
         "llama_dynamic"]
LENGTH_DEPENDENT_ROPE = ["phi3_longrope", "llama_dynamic"]
KERNEL_PATHS = [False, pytest.param(True, marks=needs_kernels)]  # the torch path, or the CPU decode and prefill kernels


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_kernels", KERNEL_PATHS)
def test_chunked_prefill_then_decode_matches_hf(checkpoint_factory, kind, use_kernels):
    ckpt = checkpoint_factory(kind)
    tokens = random_tokens(40, seed=2)
    sizes = [5, 3, 9] + [1] * 23  # chunk ends cross block boundaries (block_size 4); decode past position 32
    driver = PagedDriver(ckpt.model, block_size=4, seed=1, use_decode_kernel=use_kernels,
                         use_prefill_kernel=use_kernels)
    start = 0
    for size, reference in zip(sizes, hf_chunked_logits(ckpt.hf, tokens, sizes)):
        (logits,) = driver.step([("a", tokens, start, size)])
        start += size
        torch.testing.assert_close(logits, reference[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_step_matches_each_sequence_alone(checkpoint_factory, kind):
    ckpt = checkpoint_factory(kind)
    seqs = {name: random_tokens(n, seed=10 + i) for i, (name, n) in enumerate({"a": 11, "b": 6, "c": 33}.items())}
    driver = PagedDriver(ckpt.model, block_size=4, seed=3, use_decode_kernel=not kernels_cannot_build(),
                         use_prefill_kernel=not kernels_cannot_build())
    driver.step([("a", seqs["a"], 0, 10), ("b", seqs["b"], 0, 5), ("c", seqs["c"], 0, 7)])
    work = [("a", seqs["a"], 10, 1), ("c", seqs["c"], 7, 26), ("b", seqs["b"], 5, 1)]  # c ends past 32
    logits = driver.step(work)
    for row, (name, tokens, start, n) in enumerate(work):
        reference = hf_chunked_logits(ckpt.hf, tokens, [start, n])[1][-1]
        torch.testing.assert_close(logits[row], reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_equals_hf_generate(checkpoint_factory, kind):
    ckpt = checkpoint_factory(kind)
    prompt = random_tokens(9, seed=30)
    expected = hf_greedy(ckpt.hf, prompt, 30)
    driver = PagedDriver(ckpt.model, block_size=4, seed=5, use_decode_kernel=not kernels_cannot_build())
    tokens = list(prompt)
    (logits,) = driver.step([("a", tokens, 0, len(tokens))])
    while len(tokens) < len(expected):
        tokens.append(int(logits.argmax()))
        (logits,) = driver.step([("a", tokens, len(tokens) - 1, 1)])
    assert tokens == expected
    assert len(set(tokens[len(prompt) :])) > 3  # the model does not just repeat one token


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_equals_hf_generate(checkpoint_factory, kind):
    """The serving path: scheduler, chunked prefill, ModelRunner (with the decode kernel where it builds).
    29 + 12 runs past position 32 in decode; the prompt of 37 is prefilled in chunks (16, 16, 5) that transformers
    computes in one pass, which length-dependent RoPE must rotate as that one pass does."""
    ckpt = checkpoint_factory(kind)
    prompts = [random_tokens(n, seed=40 + n) for n in (7, 29, 12, 37)]
    results = _engine_greedy(_engine(ckpt.directory), prompts, 12)
    for prompt, (tokens, logprobs) in zip(prompts, results):
        expected_tokens, expected_logprobs = hf_greedy_logprobs(ckpt.hf, prompt, 12)
        assert tokens == expected_tokens
        if kind == "phi3_longrope" and len(prompt) <= 32 < len(prompt) + 12:
            num_exact = 33 - len(prompt)  # up to the switch to the long factors (see test_longrope_switch_...)
            logprobs, expected_logprobs = logprobs[:num_exact], expected_logprobs[:num_exact]
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=ATOL, rtol=0)


@pytest.mark.xfail(strict=True, reason="the engine keeps the K/V of a LongRoPE sequence computed before it passed "
                   "original_max_position_embeddings; transformers' Phi-3 generate recomputes them with the long "
                   "factors")
def test_longrope_switch_in_decode_matches_hf_generate(checkpoint_factory):
    """transformers' Phi3ForCausalLM.prepare_inputs_for_generation drops the cache at the step whose sequence first
    passes original_max_position_embeddings (32 here) and recomputes every token with the long factors; the
    engine rotates only the tokens from there on with them. Tokens agree on this checkpoint, log-probabilities
    after the switch differ by ~0.03."""
    ckpt = checkpoint_factory("phi3_longrope")
    prompt = random_tokens(29, seed=69)
    ((_, logprobs),) = _engine_greedy(_engine(ckpt.directory), [prompt], 12)
    _, expected_logprobs = hf_greedy_logprobs(ckpt.hf, prompt, 12)
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", LENGTH_DEPENDENT_ROPE)
def test_prefix_hits_never_cross_prompts_that_rotate_differently(checkpoint_factory, kind):
    """A prompt's K/V under length-dependent RoPE depend on the prompt's length past position 32: the longer
    prompt must not reuse the blocks of a shorter one that rotated differently, and equal rotations still share."""
    ckpt = checkpoint_factory(kind)
    engine = _engine(ckpt.directory)
    short = random_tokens(20, seed=60)  # all within 32: LongRoPE's short factors, dynamic NTK's plain base
    long = short + random_tokens(17, seed=61)  # 37: long factors, NTK base of 37 for all 37 prompt tokens
    longer = long + random_tokens(4, seed=62)  # 41: the same long factors; dynamic NTK's base of 41
    cached = {}
    for name, prompt in (("short", short), ("long", long), ("longer", longer)):
        ((tokens, logprobs),) = _engine_greedy(engine, [prompt], 4, cached)
        expected_tokens, expected_logprobs = hf_greedy_logprobs(ckpt.hf, prompt, 4)
        assert tokens == expected_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=ATOL, rtol=0)
    assert cached[len(long)] == 0
    assert cached[len(longer)] == (36 if kind == "phi3_longrope" else 0)  # 9 blocks of 4, rotated as it would


@pytest.mark.parametrize(("kind", "removed"), [("mistral", "window"), ("qwen2_window", "window"),
                                               ("gemma2", "window"), ("gemma2", "softcap"), ("gemma3", "window")])
def test_the_tests_depend_on_the_mask_and_the_softcap(checkpoint_factory, kind, removed):
    """Guards the test configs: without the sliding-window mask or the soft-cap the output is far from HF's."""
    ckpt = checkpoint_factory(kind)
    model = load_model(ckpt.directory, torch.float32, torch.device("cpu"))
    attention = [layer.self_attn for layer in model.model.layers if getattr(layer.self_attn, removed) is not None]
    assert attention
    for module in attention:
        setattr(module, removed, None)
    tokens = random_tokens(37, seed=1)
    difference = (PagedDriver(model).all_logits("a", tokens) - hf_logits(ckpt.hf, tokens)).abs().max()
    assert difference > 100 * ATOL


def _engine_greedy(engine: LLMEngine, prompts: list[list[int]], num_new: int, num_cached: dict | None = None):
    """(tokens, log-probabilities) of each prompt, generated greedily together; num_cached: prompt length ->
    prompt tokens served from the prefix cache."""
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [f"greedy-{len(prompt)}-{i}" for i, prompt in enumerate(prompts)]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(NewRequest(request_id, tuple(prompt), params))
    results: dict[str, tuple[list[int], list[float]]] = {request_id: ([], []) for request_id in ids}
    pending = set(ids)
    while pending:
        for output in engine.step():
            tokens, logprobs = results[output.request_id]
            tokens += output.new_token_ids
            logprobs += [entry.logprob for entry in output.logprobs]
            if num_cached is not None:
                num_cached[output.num_prompt_tokens] = output.num_cached_prompt_tokens
            if output.finished:
                pending.discard(output.request_id)
    return [results[request_id] for request_id in ids]


def _engine(directory) -> LLMEngine:
    add_tokenizer(directory)
    return LLMEngine(EngineConfig(model_dir=str(directory), device="cpu", num_kv_blocks=64, block_size=4,
                                  max_num_batched_tokens=16))

