"""Tiny random HF checkpoints and a small paged-KV driver for the model tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import transformers

from flotilla.engine.model import AttentionMetadata, LlamaForCausalLM, SeqChunk, allocate_kv_cache, prefill_kernel
from flotilla.models.toy_tokenizer import toy_tokenizer_json

VOCAB = 512
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # no early stop: generation runs the full length on both sides
    pad_token_id=None,
)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32, "rope_theta": 10000.0}
# name -> (HF config class, model class, config overrides)
KINDS = {
    "llama_gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_mha_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                       {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    {"rope_parameters": _LLAMA3, "num_key_value_heads": 1}),
    "linear_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}),
    "qwen2_tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    # head_dim 24 != hidden / heads: the q/k norms and projections must follow head_dim
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24}),
    # partial rotary: 12 of 16 dims rotate; LongRoPE: short factors up to 32 positions, long ones past them
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"partial_rotary_factor": 0.75}),
    "phi3_longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {
        "original_max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0], "long_factor": [1.5, 2, 4, 8, 16, 32]},
    }),
    # 6 experts, top 2, renormalised; layer 1 dense (mlp_only_layers); head_dim 24 as for qwen3
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "head_dim": 24, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "norm_topk_prob": True, "mlp_only_layers": [1],
    }),
    # Qwen2 with its window on layer 1 only (max_window_layers); sequences of the tests pass the window of 8
    "qwen2_window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    # layer 0 slides over 8 keys, layer 1 is global; soft-caps small enough to change every score and logit.
    # Untied: with tied embeddings a random Gemma's greedy output repeats one token (the residual stream holds
    # the scaled input embedding, which lm_head scores highest); gemma3_tied covers tying.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, {
        "head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 8, "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 4.0, "tie_word_embeddings": False,
    }),
    # layers 0 and 1 slide (local RoPE theta 100), layer 2 global (linear RoPE); attn_logit_softcapping is set
    # but transformers' Gemma 3 never applies it
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {
        "num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "head_dim": 24, "query_pre_attn_scalar": 32, "sliding_window": 8, "final_logit_softcapping": 6.0,
        "attn_logit_softcapping": 3.0, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}},
        "tie_word_embeddings": False,
    }),
    "gemma3_tied": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2}),
    # YaRN stretching 64 positions 4x (default attention factor, betas 32/1); static, so any length is exact
    "llama_yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                            "rope_theta": 10000.0}}),
    # dynamic NTK past max_position_embeddings 32: the tests' sequences run past it
    "llama_dynamic": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}),
}


def make_checkpoint(directory: Path, kind: str, seed: int = 0) -> transformers.PreTrainedModel:
    """Saves a random checkpoint of `kind` into `directory` and returns the HF model (float32, eval)."""
    config_cls, model_cls, overrides = KINDS[kind]
    config = config_cls(**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            # std 0.25 so the output depends on the context (see STYLE.md)
            param.normal_(0.0, 0.25)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def fresh_rope(hf_model) -> transformers.PreTrainedModel:
    """Back to the frequencies HF starts with. Its dynamic NTK RoPE keeps the frequencies of the longest
    sequence it has seen until a forward pass shorter than max_position_embeddings; a served request starts
    fresh, so every reference does."""
    rotary = hf_model.model.rotary_emb
    if getattr(rotary, "rope_type", None) == "dynamic":
        rotary.register_buffer("inv_freq", rotary.original_inv_freq, persistent=False)
        rotary.max_seq_len_cached = rotary.original_max_seq_len
    return hf_model


def hf_chunked_logits(hf_model, tokens: list[int], chunk_sizes: list[int]) -> list[torch.Tensor]:
    """HF logits [num_tokens, vocab] of each chunk, fed one after another through its KV cache (what LongRoPE
    and dynamic RoPE compute depends on how a sequence is fed, in transformers as here)."""
    fresh_rope(hf_model)
    cache = transformers.DynamicCache()
    outputs, start = [], 0
    with torch.inference_mode():
        for size in chunk_sizes:
            out = hf_model(torch.tensor([tokens[start : start + size]]), cache=cache, use_cache=True)
            outputs.append(out.logits[0].float())
            start += size
    return outputs


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """HF logits [len(tokens), vocab] of one sequence, float32."""
    with torch.inference_mode():
        return fresh_rope(hf_model)(torch.tensor([tokens])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy `generate`: prompt + num_new tokens."""
    with torch.inference_mode():
        out = fresh_rope(hf_model).generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)
    return out[0].tolist()


def hf_greedy_logprobs(hf_model, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy `generate`: the num_new tokens and the log-probability of each (float32 logits)."""
    with torch.inference_mode():
        out = fresh_rope(hf_model).generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                                            output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


class PagedDriver:
    """Plays the engine: per-sequence block tables drawn from a shuffled free list, one step at a time."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int = 96,
        block_size: int = 4,
        seed: int = 0,
        use_decode_kernel: bool = False,
        use_prefill_kernel: bool = False,
    ) -> None:
        """use_decode_kernel / use_prefill_kernel: one-token / longer chunks go through the CPU kernels, as in the
        engine."""
        self.model = model
        self.block_size = block_size
        self.use_decode_kernel = use_decode_kernel
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, dtype, torch.device("cpu"))
        self.use_prefill_kernel = use_prefill_kernel and prefill_kernel.applies(self.kv_caches[0])
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, unordered block tables
        self.tables: dict[str, list[int]] = {}

    def chunk(self, seq_id: str, start: int, num_tokens: int) -> SeqChunk:
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < start + num_tokens:
            table.append(self.free.pop())
        return SeqChunk(start, num_tokens, list(table))

    def step(self, work: list[tuple[str, list[int], int, int]]) -> torch.Tensor:
        """work: (seq_id, all tokens, start, num_tokens) per chunk -> last-token logits [len(work), vocab]."""
        chunks = [self.chunk(seq_id, start, n) for seq_id, _, start, n in work]
        return self.run(chunks, [tokens[start : start + n] for _, tokens, start, n in work])

    def run(self, chunks: list[SeqChunk], token_lists: list[list[int]]) -> torch.Tensor:
        cpu = torch.device("cpu")
        meta = AttentionMetadata.build(chunks, self.block_size, cpu, use_decode_kernel=self.use_decode_kernel,
                                       sliding_window=self.model.config.sliding_window,
                                       use_prefill_kernel=self.use_prefill_kernel)
        input_ids = torch.tensor([t for tokens in token_lists for t in tokens])
        with torch.inference_mode():
            hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)
            last_rows = torch.tensor([len(tokens) for tokens in token_lists]).cumsum(0) - 1
            return self.model.compute_logits(hidden[last_rows])

    def all_logits(self, seq_id: str, tokens: list[int]) -> torch.Tensor:
        """One prefill chunk of the whole sequence, logits of every position."""
        meta = AttentionMetadata.build([self.chunk(seq_id, 0, len(tokens))], self.block_size, torch.device("cpu"),
                                       sliding_window=self.model.config.sliding_window,
                                       use_prefill_kernel=self.use_prefill_kernel)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(tokens), meta.positions, meta, self.kv_caches)
            return self.model.compute_logits(hidden)


def add_tokenizer(directory) -> None:
    """The engine needs a tokenizer.json; token ids are all the tests use."""
    if not (directory / "tokenizer.json").exists():
        (directory / "tokenizer.json").write_text(toy_tokenizer_json(VOCAB))
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
