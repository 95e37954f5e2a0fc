"""Tokenizer: encoding and chat templates match transformers' AutoTokenizer on the same directory."""

import json
import shutil

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors
from transformers import AutoTokenizer

from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.tokenizer import Tokenizer


TEXTS = [
    "",
    "Hello, world!",
    "def add(a, b):\n    return a + b  # 1234567890\n\n\n",
    "héllo wörld — naïve café, Ωμέγα, Привет мир",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "emoji 😀🙃👨‍👩‍👧 flags 🇫🇷 and ZWJ",
    "e\u0301 vs \u00e9 (NFC matters)",
    "  leading and trailing   spaces\t\ttabs\r\nCRLF ",
    "special tokens inline: <|im_start|>user\nhi<|im_end|><|endoftext|>",
    "I'LL don't we've they're",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Système: réponds en français 🇫🇷"},
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Salut !"},
        {"role": "user", "content": [{"type": "text", "text": "Et "}, {"type": "text", "text": "toi ?"}]},
    ],
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def both(request, checkpoint_factory):
    # transformers picks a different tokenizer class per model type (Qwen2Tokenizer rebuilds its pipeline).
    path = checkpoint_factory(architecture=request.param)
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(both, text):
    ours, theirs = both
    for add_special_tokens in (True, False):
        assert ours.encode(text, add_special_tokens) == theirs.encode(text, add_special_tokens=add_special_tokens)


def test_decode_matches_transformers(both):
    ours, theirs = both
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(both, messages, add_generation_prompt):
    ours, theirs = both
    text = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == text
    ids = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == ids


def test_chatml_rendering_with_system_prompt(tiny_checkpoint):
    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint)
    text = tokenizer.apply_chat_template(CONVERSATIONS[1])
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode_chat(CONVERSATIONS[1])
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and ids.count(tokenizer.token_to_id("<|im_end|>")) == 2


def test_special_token_ids(tiny_checkpoint):
    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint)
    assert tokenizer.vocab_size == 8192
    assert tokenizer.bos_token_id == tokenizer.token_to_id("<|endoftext|>") == 0
    assert tokenizer.eos_token_ids == {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")}
    assert tokenizer.special_token_ids == {0, 1, 2}


@pytest.mark.parametrize("messages, complaint", [
    ("hello", "list"),
    ([], "at least one"),
    (["hello"], "object"),
    ([{"content": "hi"}], "no role"),
    ([{"role": "wizard", "content": "hi"}], "unknown role"),
    ([{"role": "user"}], "no content"),
    ([{"role": "user", "content": 42}], "string or a list"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "parts"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}], "system message must be the first"),
])
def test_malformed_messages_are_invalid_requests(tiny_checkpoint, messages, complaint):
    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint)
    with pytest.raises(InvalidRequestError) as caught:
        tokenizer.apply_chat_template(messages)
    assert caught.value.field == "messages" and complaint in caught.value.message


def test_assistant_tool_call_without_content_is_accepted(tiny_checkpoint):
    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n<|im_end|>\n")


# A template using the helpers transformers provides (tojson, namespace, loop controls, raise_exception,
# strftime_now, bos_token and extra variables), to check our environment renders it the same way.
FEATURE_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for message in messages %}
  {% if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
  {% if loop.index > 20 %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  [{{ message.role | upper }}] {{ message.content | tojson }}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson(indent=2) }}{% endif %}
n={{ ns.n }} year_ok={{ strftime_now('%Y') | length == 4 }} mood={{ mood | default('none') }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOL_TEMPLATE = "TOOL MODE {% for t in tools %}{{ t.name }};{% endfor %}{{ messages[-1].content }}"


def _variant(src, dst, config_changes, files=None):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(text)
    return Tokenizer.from_pretrained(dst), AutoTokenizer.from_pretrained(dst)


def test_template_helpers_render_like_transformers(tiny_checkpoint, tmp_path):
    ours, theirs = _variant(tiny_checkpoint, tmp_path, {"chat_template": FEATURE_TEMPLATE})
    messages = [{"role": "system", "content": 'quote " and <tag> & ünïcode'}, {"role": "user", "content": "hi"}]
    tools = [{"name": "get_weather", "parameters": {"city": "string"}}]
    for kwargs in ({}, {"mood": "cheerful"}, {"tools": tools}):
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
    assert "year_ok=True" in expected and '"quote \\" and <tag> & ünïcode"' in expected


def test_named_templates_are_chosen_like_transformers(tiny_checkpoint, tmp_path):
    named = [{"name": "default", "template": FEATURE_TEMPLATE}, {"name": "tool_use", "template": TOOL_TEMPLATE}]
    ours, theirs = _variant(tiny_checkpoint, tmp_path, {"chat_template": named})
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"name": "get_weather"}]
    cases = [{}, {"tools": tools}, {"chat_template": "tool_use", "tools": tools}, {"chat_template": "default"}]
    for kwargs in cases:
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
    assert ours.apply_chat_template(messages, tools=tools).startswith("TOOL MODE get_weather;")


def test_template_files_override_tokenizer_config(tiny_checkpoint, tmp_path):
    files = {"chat_template.jinja": FEATURE_TEMPLATE, "additional_chat_templates/tool_use.jinja": TOOL_TEMPLATE}
    ours, theirs = _variant(tiny_checkpoint, tmp_path, {}, files)
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"tools": [{"name": "t"}]}):
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
    assert ours.apply_chat_template(messages).startswith("<|endoftext|>")


def test_template_raise_exception_becomes_invalid_request(tiny_checkpoint, tmp_path):
    ours, _ = _variant(tiny_checkpoint, tmp_path, {"chat_template": FEATURE_TEMPLATE})
    with pytest.raises(InvalidRequestError, match="bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_bos_adding_post_processor_matches_transformers(tiny_checkpoint, tmp_path):
    # A Llama-3 style tokenizer.json whose post-processor prepends the BOS token.
    backend = BackendTokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(tiny_checkpoint / name, tmp_path / name)
    ours, theirs = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode("hi")[0] == 0
    messages = CONVERSATIONS[1]
    assert ours.encode_chat(messages) == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                                    return_dict=False)
