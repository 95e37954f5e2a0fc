"""IncrementalDetokenizer: deltas are complete text and add up to tokenizer.decode(all ids)."""

import json
import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from flotilla.engine.detokenizer import MAX_STALE_TOKENS, IncrementalDetokenizer
from flotilla.engine.tokenizer import Tokenizer
from flotilla.models.toy_tokenizer import corpus_texts


UNICODE_TEXT = "héllo wörld 你好世界 😀🙃 Привет 👨‍👩‍👧 ok 日本語 한국어 ∑∫ 🇫🇷 end"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(write_sentencepiece_style_tokenizer(tmp_path_factory.mktemp("spm")))


def write_sentencepiece_style_tokenizer(path):
    """A Llama-2 style tokenizer: '▁' for spaces, <0xNN> byte fallback, decoder strips the first space."""
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=100,
                                  show_progress=False)
    trained = BackendTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(corpus_texts(200_000), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) for merge in model["merges"]]
    backend = BackendTokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.pre_tokenizer = trained.pre_tokenizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def stream(tokenizer, token_ids, chunk_sizes=None, **kwargs):
    detokenizer = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, start = [], 0
    for size in chunk_sizes or [1] * len(token_ids):
        deltas.append(detokenizer.push(token_ids[start:start + size]))
        start += size
    final = detokenizer.flush()
    assert detokenizer.text == "".join(deltas) + final
    return deltas, final


def test_unicode_text_streams_in_whole_characters(tokenizer):
    ids = tokenizer.encode(UNICODE_TEXT)
    deltas, final = stream(tokenizer, ids)
    assert "".join(deltas) == UNICODE_TEXT and final == ""
    assert all("\ufffd" not in delta for delta in deltas)
    # The vocabulary splits characters across tokens, so some pushes must have held text back.
    assert deltas.count("") >= 5


def test_random_chunking_gives_the_same_text(tokenizer):
    rng = random.Random(7)
    ids = tokenizer.encode(UNICODE_TEXT * 3)
    for _ in range(20):
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(rng.randint(0, 5))
        deltas, final = stream(tokenizer, ids, sizes)
        assert "".join(deltas) + final == UNICODE_TEXT * 3


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fuzz_random_token_ids(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 50))]
        if rng.random() < 0.3:  # plenty of special tokens mixed in
            ids = [rng.choice(sorted(tokenizer.special_token_ids)) if rng.random() < 0.2 else i for i in ids]
        deltas, final = stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + final == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert not any(delta.endswith("\ufffd") for delta in deltas)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tokenizer, ids)[0]) == "hi"
    assert "".join(stream(tokenizer, ids, skip_special_tokens=False)[0]) == "hi<|im_end|>"


def test_prompt_is_context_not_output(tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Say 你好"}])
    generated = tokenizer.encode("你好 😀!")
    deltas, final = stream(tokenizer, generated, prompt_token_ids=prompt)
    assert "".join(deltas) + final == "你好 😀!"


def test_window_stays_small(tokenizer):
    decoded_lengths = []
    original = tokenizer.decode

    class Recording:
        special_token_ids = tokenizer.special_token_ids
        byte_fallback_token_ids = tokenizer.byte_fallback_token_ids

        def decode(self, ids, skip_special_tokens=True):
            decoded_lengths.append(len(ids))
            return original(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(UNICODE_TEXT * 80)
    deltas, final = stream(Recording(), ids)
    assert "".join(deltas) + final == UNICODE_TEXT * 80
    # Long enough that old ids get dropped too (MAX_STALE_TOKENS).
    assert len(ids) > 2 * MAX_STALE_TOKENS and max(decoded_lengths) <= 8  # O(window), never a full re-decode


def test_byte_fallback_tokenizer_streams_exactly(byte_fallback_tokenizer):
    tokenizer = byte_fallback_tokenizer
    ids = tokenizer.encode(UNICODE_TEXT)
    assert tokenizer.byte_fallback_token_ids and set(ids) & tokenizer.byte_fallback_token_ids
    deltas, final = stream(tokenizer, ids)
    assert "".join(deltas) + final == tokenizer.decode(ids) == UNICODE_TEXT


def test_byte_fallback_fuzz_random_ids(byte_fallback_tokenizer):
    # An invalid byte turns its whole <0xNN> run into U+FFFDs, even bytes that looked complete before it.
    tokenizer, rng = byte_fallback_tokenizer, random.Random(99)
    byte_ids = sorted(tokenizer.byte_fallback_token_ids)
    for _ in range(300):
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randint(1, 40))]
        deltas, final = stream(tokenizer, ids)
        assert "".join(deltas) + final == tokenizer.decode(ids)


def test_sentencepiece_leading_space_kept_with_prompt_context(byte_fallback_tokenizer):
    tokenizer = byte_fallback_tokenizer
    prompt = tokenizer.encode("Tell me")
    full = tokenizer.encode("Tell me something")
    generated = full[len(prompt):]
    deltas, final = stream(tokenizer, generated, prompt_token_ids=prompt)
    assert "".join(deltas) + final == " something"
    assert "".join(stream(tokenizer, generated)[0]) == tokenizer.decode(generated) == "something"
