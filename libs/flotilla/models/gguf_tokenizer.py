"""The tokenizer a GGUF file describes, rebuilt as a Hugging Face tokenizer.json (byte-level BPE vocabularies).

A GGUF carries no tokenizer.json: it stores the vocabulary, the merges, each token's type and the name of
llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`), whose text splitting is fixed in llama.cpp's code. Each name
supported here maps to the `tokenizers` pre-tokenizer that splits text the same way; any other name, and
SentencePiece vocabularies (`tokenizer.ggml.model` 'llama'), raise GGUFError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

# llama.cpp's token types (llama_token_type)
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer name -> how its regexes split text. "gpt2": GPT-2's regex alone; "digits+gpt2": each
# digit on its own first (llama.cpp's `\p{N}` rule before GPT-2's regex, as SmolLM's and StarCoder's tokenizers
# do); a regex: that split, then byte-level without GPT-2's regex.
_PRE_TOKENIZERS = {
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "smollm": "digits+gpt2", "starcoder": "digits+gpt2", "refact": "digits+gpt2", "command-r": "digits+gpt2",
    "codeshell": "digits+gpt2", "exaone": "digits+gpt2",
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies whose tokens may be looked up whole before merging (llama.cpp's ignore_merges).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "smaug-bpe", "dbrx"})


class GGUFError(ValueError):
    """A GGUF file that cannot be turned into a checkpoint; the message names what is unsupported."""


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2')")
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES))
    tokenizer.pre_tokenizer = _pre_tokenizer(_PRE_TOKENIZERS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, tokens, metadata.get("tokenizer.ggml.token_type") or [])
    if metadata.get("tokenizer.ggml.add_bos_token") and metadata.get("tokenizer.ggml.bos_token_id") is not None:
        tokenizer.post_processor = _prepend_bos(tokens, int(metadata["tokenizer.ggml.bos_token_id"]))
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _pre_tokenizer(split: str) -> pre_tokenizers.PreTokenizer:
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _add_tokens(tokenizer: Tokenizer, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Control tokens (<|im_start|>, ...) become special added tokens, user-defined ones plain added tokens, so
    that both are matched whole in text, as llama.cpp does."""
    special = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN]
    plain = [AddedToken(token, normalized=False, special=False)
             for token, kind in zip(tokens, token_types) if kind == USER_DEFINED_TOKEN]
    if special:
        tokenizer.add_special_tokens(special)
    if plain:
        tokenizer.add_tokens(plain)


def _prepend_bos(tokens: Sequence[str], bos_token_id: int) -> processors.PostProcessor:
    bos = tokens[bos_token_id]
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_token_id)])
