"""A small byte-level BPE tokenizer for test checkpoints, trained offline on text every machine has.

The training text is the Python standard library's top-level modules (a fixed, sorted list, capped in
size) plus a generated multilingual block, so that the vocabulary also holds tokens that split multi-byte
UTF-8 characters (what streaming detokenization has to cope with). Training is deterministic and takes
about a second; the result is cached on disk keyed by the vocabulary size and a fingerprint of everything
that goes into training, so a cache hit returns exactly what training would.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

MAX_CORPUS_CHARS = 3_000_000
# Qwen2's pre-tokenizer split (digits one by one, letters grouped). We use Qwen2's whole pipeline (NFC,
# this split, byte-level without its own regex) for every architecture because transformers rebuilds a
# "qwen2" checkpoint's tokenizer with exactly that pipeline whatever tokenizer.json says; with it, our
# tokenizer.json and transformers' tokenizer encode alike for all three architectures.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Bump when anything about training changes, so stale cache entries are never used.
RECIPE_VERSION = "1"

# Scripts beyond ASCII: Latin-1 accents, Greek, Cyrillic, CJK, Hangul, emoji (4-byte UTF-8).
_UNICODE_RANGES = ((0x00C0, 0x00FF), (0x0391, 0x03C9), (0x0410, 0x044F), (0x4E00, 0x51FF),
                   (0xAC00, 0xAFFF), (0x1F600, 0x1F64F))


def multilingual_text(num_words: int = 20_000) -> str:
    """Deterministic pseudo-words drawn from several scripts (no RNG, so identical on every Python)."""
    words = []
    for i in range(num_words):
        low, high = _UNICODE_RANGES[i % len(_UNICODE_RANGES)]
        span = high - low + 1
        # Skewed choice so some characters are frequent enough to earn merges of their own.
        chars = [chr(low + ((i * 7919 + j * 104729) % span) % max(1, span // (1 + j * 3))) for j in range(1 + i % 4)]
        words.append("".join(chars))
    return " ".join(words)


def corpus_texts(max_chars: int = MAX_CORPUS_CHARS) -> list[str]:
    """The training text: sorted stdlib modules, capped at max_chars, then the multilingual block."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    num_chars = 0
    for path in sorted(stdlib.glob("*.py")):
        if num_chars >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")[: max_chars - num_chars]
        texts.append(text)
        num_chars += len(text)
    texts.append(multilingual_text())
    return texts


def corpus_fingerprint(texts: list[str], vocab_size: int) -> str:
    digest = hashlib.sha256()
    for part in (RECIPE_VERSION, tokenizers.__version__, str(vocab_size), PRETOKENIZE_REGEX, *SPECIAL_TOKENS):
        digest.update(part.encode() + b"\0")
    for text in texts:
        digest.update(text.encode("utf-8", errors="surrogatepass") + b"\0")
    return digest.hexdigest()[:32]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained vocabulary has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer


def cache_dir() -> Path:
    root = os.environ.get("FLOTILLA_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "flotilla"


def toy_tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json text for a byte-level BPE of vocab_size tokens; trained once, then read from cache."""
    texts = corpus_texts()
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{corpus_fingerprint(texts, vocab_size)}.json"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        pass
    text = train_tokenizer(texts, vocab_size).to_str(pretty=True)
    _try_write_atomically(path, text)
    return text


def _try_write_atomically(path: Path, text: str) -> None:
    # The cache is only a speed-up: a read-only home or a race with another process must not fail a caller.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8", newline="")
        os.replace(tmp, path)
    except OSError:
        pass
