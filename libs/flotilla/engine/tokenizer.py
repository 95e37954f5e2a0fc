"""Tokenizer for any Hugging Face checkpoint directory with a tokenizer.json, without transformers.

Encoding matches transformers' AutoTokenizer(dir).encode, and chat templates render as transformers'
apply_chat_template does (same jinja2 sandbox, options and helpers), so prompts are token-identical to
what the model was trained and evaluated with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken

from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.tokenizer_files import EXTRA_TEMPLATES_DIR, TokenizerFiles, read_tokenizer_files

# Named special tokens, as transformers' SPECIAL_TOKENS_ATTRIBUTES; templates see them as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool"})
# transformers copies a message's reasoning under each of these names (the first is what templates read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A tokenizers.Tokenizer plus what tokenizer_config.json and generation_config.json add to it."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | Mapping[str, str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ):
        self._backend = backend
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"), bos_token_id)
        eos_token_id = self._token_id(self.special_tokens.get("eos_token"), None)
        self.eos_token_ids = frozenset({*extra_eos_token_ids, *([eos_token_id] if eos_token_id is not None else [])})
        self.special_token_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self.byte_fallback_token_ids = _byte_fallback_token_ids(backend)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        return cls.from_files(read_tokenizer_files(model_dir))

    @classmethod
    def from_files(cls, files: TokenizerFiles) -> Tokenizer:
        """From a checkpoint's tokenizer files (tokenizer_files.py), as read from its directory or received."""
        if "tokenizer.json" not in files:
            raise FileNotFoundError("tokenizer.json not found (only tokenizer.json checkpoints are supported)")
        backend = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        config = _read_json(files, "tokenizer_config.json")
        special_tokens = _special_tokens(config, _read_json(files, "special_tokens_map.json"))
        _add_missing_special_tokens(backend, special_tokens)
        generation = _generation_token_ids(files)
        return cls(backend, special_tokens, _chat_templates(files, config), generation.eos, generation.bos)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, special tokens added here included (for llguidance)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for messages, rendered like transformers' apply_chat_template(tokenize=False).

        chat_template is the name of one of the checkpoint's templates, or a template itself; extra keyword
        arguments become template variables (e.g. enable_thinking) and override the special-token variables.
        """
        checked = validate_messages(messages)
        template = self.select_chat_template(chat_template, tools)
        compiled = compile_chat_template(template)  # a broken template is the checkpoint's fault: not caught
        variables = {**self.special_tokens, **extra}
        try:
            return compiled.render(
                messages=_alias_reasoning_fields(checked),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as error:
            # The template rejected these messages (raise_exception, or content of a shape it cannot render).
            raise InvalidRequestError("messages", f"chat template failed: {error}") from error

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Token ids of the rendered chat; special tokens come from the template only, as in transformers."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False)

    def select_chat_template(self, name_or_template: str | None = None, tools: list[Any] | None = None) -> str:
        """The template to render, chosen as transformers' get_chat_template chooses it."""
        templates = self.chat_template
        if isinstance(templates, Mapping):
            if name_or_template is not None:
                return templates.get(name_or_template, name_or_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"checkpoint has several chat templates and no default: {sorted(templates)}")
        if name_or_template is not None:
            return name_or_template
        if templates is None:
            raise ValueError("checkpoint has no chat template")
        return templates

    def _token_id(self, token: str | None, fallback: int | None) -> int | None:
        token_id = self._backend.token_to_id(token) if token is not None else None
        return token_id if token_id is not None else fallback


def _byte_fallback_token_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of <0xNN> byte tokens when the decoder joins runs of them (SentencePiece byte fallback)."""
    decoder = backend.decoder
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():  # the decoder's JSON
        return frozenset()
    byte_tokens = (backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
    return frozenset(token_id for token_id in byte_tokens if token_id is not None)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked copies of chat messages with None-valued keys dropped (as transformers does before rendering)."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError("messages", f"must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise InvalidRequestError("messages", "must contain at least one message")
    return [_validate_message(index, message) for index, message in enumerate(messages)]


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError("messages", f"message {index} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequestError("messages", f"message {index} has no role")
    if role not in MESSAGE_ROLES:
        raise InvalidRequestError("messages", f"message {index} has unknown role {role!r}")
    content = message.get("content")
    # An assistant message that only calls tools may have no content.
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise InvalidRequestError("messages", f"message {index} ({role}) has no content")
    if content is not None and not isinstance(content, (str, list)):
        raise InvalidRequestError("messages", f"message {index} content must be a string or a list of parts")
    if isinstance(content, list) and not all(isinstance(part, Mapping) and "type" in part for part in content):
        raise InvalidRequestError("messages", f"message {index} content parts must be objects with a type")
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning_fields(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in messages:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


# -- loading ------------------------------------------------------------------------------------------------


class _GenerationTokenIds(NamedTuple):
    eos: list[int]
    bos: int | None


def _read_json(files: TokenizerFiles, name: str) -> dict[str, Any]:
    if name not in files:
        return {}
    value = json.loads(files[name].decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{name} must hold a JSON object")
    return value


def _token_content(value: Any) -> str | None:
    # Special tokens are written either as strings or as serialized AddedTokens ({"content": ...}).
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: Mapping[str, Any], legacy_map: Mapping[str, Any]) -> dict[str, str]:
    merged = dict(config)
    # transformers reads the legacy special_tokens_map.json only when the config has no added_tokens_decoder.
    if "added_tokens_decoder" not in config:
        merged.update(legacy_map)
    tokens = {name: _token_content(merged.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: token for name, token in tokens.items() if token is not None}


def _add_missing_special_tokens(backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str]) -> None:
    # transformers adds named special tokens that tokenizer.json lacks; do the same so ids agree.
    missing = [token for token in special_tokens.values() if backend.token_to_id(token) is None]
    if missing:
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in missing])


def _generation_token_ids(files: TokenizerFiles) -> _GenerationTokenIds:
    # generate() reads generation_config.json, falling back to config.json when there is none.
    config = _read_json(files, "generation_config.json") or _read_json(files, "config.json")
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else [int(token_id) for token_id in eos or []]
    bos = config.get("bos_token_id")
    return _GenerationTokenIds(eos_ids, bos if isinstance(bos, int) else None)


def _chat_templates(files: TokenizerFiles, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """Templates from chat_template.jinja and additional_chat_templates/ override tokenizer_config.json."""
    from_files: dict[str, str] = {}
    if "chat_template.jinja" in files:
        from_files["default"] = files["chat_template.jinja"].decode("utf-8")
    for name in sorted(files):
        directory, _, base = name.rpartition("/")
        if directory == EXTRA_TEMPLATES_DIR and base.endswith(".jinja"):
            from_files[base.removesuffix(".jinja")] = files[name].decode("utf-8")
    if from_files:
        return from_files["default"] if list(from_files) == ["default"] else from_files
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template if isinstance(template, str) else None


# -- jinja2 environment, as in transformers.utils.chat_template_utils -------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used for assistant masks) and renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    # dict() and dict.fromkeys() for templates, without exposing the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces reject underscore attributes so templates cannot reach CPython internals.
    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Unlike jinja2's own tojson, this does not HTML-escape, and it exposes json.dumps' options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment.from_string(template)
