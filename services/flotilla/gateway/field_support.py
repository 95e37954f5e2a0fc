"""What the gateway does with every request field of both dialects: the one table.

Each endpoint's top-level fields map to a status: Supported (it works), Unsupported (a 400 naming the field, unless
its value is null) or Partly (some values work; `check` says why another is refused). A field in no table is
refused as unknown: nothing a client sends is silently dropped. Values inside messages (content types, roles) and
tool definitions have their own small tables below. The field table in docs/api.md is generated from these tables
(`markdown_table`), and tests walk the installed `openai` and `anthropic` SDKs' request types against them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from flotilla.gateway.errors import ErrorKind, GatewayError

NEEDS_GRAMMAR = ("strict arguments while the model may also answer in text are not built; tool_choice required / "
                 "any / a named tool makes every call's arguments validate against its schema")
TEXT_ONLY = "the served models take text only"


class Supported(NamedTuple):
    note: str = ""


class Unsupported(NamedTuple):
    reason: str


class Partly(NamedTuple):
    note: str  # what works
    check: Callable[[Any], str | None]  # -> why this value is not supported, None when it is


Status = Supported | Unsupported | Partly


def _only(*allowed: Any, reason: str) -> Callable[[Any], str | None]:
    return lambda value: None if value in allowed else reason


def _structured(note: str) -> Status:
    return Supported(f"structured output: {note}")


def _anthropic_tool_choice(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return None  # the schema says what is wrong with it
    kind = value.get("type")
    if kind == "tool" and not value.get("name"):
        return "type 'tool' needs the tool's name"
    if value.get("disable_parallel_tool_use") and kind not in ("any", "tool"):
        return "disable_parallel_tool_use is supported with type any or tool (one forced call)"
    return None


def _thinking(value: Any) -> str | None:
    disabled = isinstance(value, Mapping) and value.get("type") == "disabled"
    return None if disabled else "extended thinking is not built (only {\"type\": \"disabled\"})"


def _output_config(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return None  # the schema says what is wrong with it
    return "effort is not supported" if value.get("effort") is not None else None


def _modalities(value: Any) -> str | None:
    return None if value in (["text"], []) else "only [\"text\"]: audio output is not built"


def _zero(value: Any) -> str | None:
    return None if value in (0, 0.0) else "only 0 (penalties are not built)"


NO_EFFECT = "accepted; it changes nothing here"
STICKY_VERSION = "keeps the conversation on one model version during a rollout (else a hash of its first messages)"

_OPENAI_COMMON: dict[str, Status] = {
    "model": Supported("a served model, alias or name@version; the gateway's --default-model when absent"),
    "max_tokens": Supported("required (or max_completion_tokens on chat)"),
    "temperature": Supported("[0, 2]"),
    "top_p": Supported(),
    "seed": Supported("seeded sampling, the same whatever shares the batch"),
    "stop": Supported("up to 16 strings"),
    "stream": Supported(),
    "stream_options": Partly("include_usage", _only(None, {}, {"include_usage": True}, {"include_usage": False},
                                                     reason="only include_usage")),
    "n": Partly("1 only", _only(1, reason="only n=1")),
    "presence_penalty": Partly("0 only", _zero),
    "frequency_penalty": Partly("0 only", _zero),
    "logit_bias": Partly("empty only", _only({}, reason="logit biases are not built")),
    "user": Supported(STICKY_VERSION),
    # vLLM-style extensions, in no OpenAI SDK type:
    "top_k": Supported("extension (vLLM): 0 = off"),
    "ignore_eos": Supported("extension (vLLM): generate exactly max_tokens"),
    "guided_json": _structured("extension (vLLM)"),
    "guided_regex": _structured("extension (vLLM)"),
    "guided_choice": _structured("extension (vLLM)"),
    "guided_grammar": _structured("extension (vLLM)"),
    "structured_outputs": _structured("extension (vLLM)"),
}

CHAT_FIELDS: dict[str, Status] = {
    **_OPENAI_COMMON,
    "messages": Supported("roles and content parts: see below"),
    "max_completion_tokens": Supported("same as max_tokens"),
    "logprobs": Supported(),
    "top_logprobs": Supported("0-20"),
    "tools": Supported("function tools, rendered by the model's chat template"),
    "tool_choice": Supported("auto, none, required, a named function (the last two force calls with a grammar)"),
    "parallel_tool_calls": Supported("true (default) or false: false keeps the first call"),
    "response_format": _structured("text, json_object, json_schema"),
    "functions": Unsupported("deprecated by OpenAI; use tools"),
    "function_call": Unsupported("deprecated by OpenAI; use tool_choice"),
    "audio": Unsupported("audio output is not built"),
    "modalities": Partly('["text"]', _modalities),
    "prediction": Unsupported("predicted outputs are not built"),
    "reasoning_effort": Unsupported("reasoning controls are not built"),
    "verbosity": Unsupported("verbosity controls are not built"),
    "web_search_options": Unsupported("there is no web search"),
    "moderation": Unsupported("per-request moderation settings are not built: the API key's safety policy "
                              "screens every request"),
    "store": Partly("false only", _only(False, reason="stored completions are not built")),
    "metadata": Unsupported("stored completions (which metadata tags) are not built"),
    "service_tier": Partly("auto, default", _only("auto", "default", reason="one service tier only")),
    "prompt_cache_key": Supported("accepted; the prefix cache is automatic (per tenant)"),
    "prompt_cache_options": Unsupported("the prefix cache is automatic (LRU), without options"),
    "prompt_cache_retention": Unsupported("the prefix cache is automatic (LRU), without a retention choice"),
    "safety_identifier": Supported(NO_EFFECT),
}

COMPLETION_FIELDS: dict[str, Status] = {
    **_OPENAI_COMMON,
    "prompt": Supported("one string, or one list of token ids"),
    "logprobs": Supported("0-5"),
    "echo": Partly("false only", _only(False, reason="echoing the prompt is not built")),
    "best_of": Partly("1 only", _only(1, reason="only best_of=1")),
    "response_format": _structured("extension (vLLM): as on chat completions"),
    "suffix": Unsupported("insertion (fill in the middle) is not built"),
}

MESSAGES_FIELDS: dict[str, Status] = {
    "model": Supported("a served model, alias or name@version; the gateway's --default-model when absent"),
    "messages": Supported("content blocks: see below"),
    "max_tokens": Supported("required"),
    "system": Supported("a string or text blocks"),
    "stop_sequences": Supported("up to 16 strings"),
    "stream": Supported(),
    "temperature": Supported("[0, 1] (Anthropic API field, not in the SDK's types: send it in extra_body)"),
    "top_p": Supported("(Anthropic API field, as temperature)"),
    "top_k": Supported("(Anthropic API field, as temperature)"),
    "metadata": Supported("user_id: " + STICKY_VERSION),
    "tools": Supported("custom tools, rendered by the model's chat template; server tools: see below"),
    "tool_choice": Partly("auto, none, any, tool (any / tool force calls with a grammar; "
                          "disable_parallel_tool_use with them: one call)", _anthropic_tool_choice),
    "thinking": Partly('{"type": "disabled"}', _thinking),
    "output_config": Partly("absent or null effort and format", _output_config),
    "output_format": _structured("beta name of output_config.format"),
    "cache_control": Supported("accepted; the prefix cache is automatic (per tenant)"),
    "service_tier": Supported("one tier: auto and standard_only are the same here"),
    "speed": Partly("standard", _only("standard", reason="one speed only")),
    "container": Unsupported("there is no code-execution container"),
    "diagnostics": Unsupported("diagnostics are not built"),
    "inference_geo": Unsupported("there is no region choice"),
    "user_profile_id": Unsupported("user profiles are not built"),
    "workspace_id": Unsupported("workspaces are not built"),
    # Beta fields (anthropic.types.beta):
    "betas": Unsupported("beta features are not built"),
    "mcp_servers": Unsupported("MCP connectors are not built"),
    "context_management": Unsupported("context management is not built"),
    "compaction": Unsupported("compaction is not built"),
    "fallbacks": Unsupported("model fallbacks are not built"),
    "fallback_credit_token": Unsupported("model fallbacks are not built"),
    "billing_policy": Unsupported("billing policies are not built"),
    "thread": Unsupported("threads are not built"),
}

COUNT_TOKENS_FIELDS: dict[str, Status] = {
    name: MESSAGES_FIELDS[name]
    for name in ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "output_format",
                 "cache_control", "speed", "user_profile_id", "workspace_id", "betas", "mcp_servers",
                 "context_management", "compaction", "billing_policy")
}

# -- values inside messages and tools ---------------------------------------------------------------------------

OPENAI_ROLES: dict[str, Status] = {
    "system": Supported(), "developer": Supported("rendered as system"), "user": Supported(),
    "assistant": Supported("content and tool_calls"), "tool": Supported("tool results, by tool_call_id"),
    "function": Unsupported("deprecated by OpenAI; use tool messages"),
}
OPENAI_PART_TYPES: dict[str, Status] = {
    "text": Supported(), "refusal": Supported("in assistant messages, rendered as text"),
    "image_url": Unsupported(TEXT_ONLY), "input_audio": Unsupported(TEXT_ONLY), "file": Unsupported(TEXT_ONLY),
}
OPENAI_TOOL_TYPES: dict[str, Status] = {
    "function": Supported("strict: false only (forced calls validate their arguments anyway)"),
    "custom": Unsupported("custom (free-form) tools need grammar-constrained decoding"),
}
ANTHROPIC_ROLES: dict[str, Status] = {
    "user": Supported(), "assistant": Supported("a last assistant message is continued (prefill)"),
    "system": Supported("rendered as a system message where the chat template allows it"),
}
ANTHROPIC_BLOCK_TYPES: dict[str, Status] = {
    "text": Supported("citations: null only"), "tool_use": Supported("in assistant messages"),
    "tool_result": Supported("in user messages; text content; is_error prefixes the text with 'Error: '"),
    "image": Unsupported(TEXT_ONLY), "document": Unsupported(TEXT_ONLY),
    "search_result": Unsupported("search results are not built"),
    "thinking": Unsupported("extended thinking is not built"),
    "redacted_thinking": Unsupported("extended thinking is not built"),
    "container_upload": Unsupported("there is no code-execution container"),
}
ANTHROPIC_CUSTOM_TOOL = Supported("custom tools (type absent or \"custom\"); strict: false only")
SERVER_TOOL = Unsupported("server tools are not built (only custom tools)")


# -- checks -----------------------------------------------------------------------------------------------------


def unsupported(path: str, reason: str) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST, f"{path} is not supported: {reason}", param=path,
                        code="unsupported_field")


def check_fields(table: Mapping[str, Status], document: Mapping[str, Any]) -> None:
    """Refuses (400) the first top-level field that is unknown, unsupported, or set to a value not supported."""
    for name, value in document.items():
        status = table.get(name)
        if status is None:
            raise unsupported(name, "not a field of this endpoint")
        if value is None or type(status) is Supported:
            continue
        reason = status.reason if type(status) is Unsupported else status.check(value)
        if reason is not None:
            raise unsupported(name, reason)


def check_openai_messages(messages: Any) -> None:
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, Mapping):
            continue  # the schema refuses it
        _check_value(f"messages.{i}.role", OPENAI_ROLES, message.get("role"))
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            _check_type(f"messages.{i}.content.{j}.type", OPENAI_PART_TYPES, part)


def check_openai_tools(tools: Any) -> None:
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        _check_type(f"tools.{i}.type", OPENAI_TOOL_TYPES, tool)
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("strict"):
            raise unsupported(f"tools.{i}.function.strict", NEEDS_GRAMMAR)


def check_anthropic_messages(messages: Any) -> None:
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, Mapping):
            continue  # the schema refuses it
        _check_value(f"messages.{i}.role", ANTHROPIC_ROLES, message.get("role"))
        content = message.get("content")
        for j, block in enumerate(content if isinstance(content, list) else ()):
            _check_type(f"messages.{i}.content.{j}.type", ANTHROPIC_BLOCK_TYPES, block)
            inner = block.get("content") if isinstance(block, Mapping) else None
            for k, part in enumerate(inner if isinstance(inner, list) else ()):  # a tool_result's content
                _check_type(f"messages.{i}.content.{j}.content.{k}.type", ANTHROPIC_BLOCK_TYPES, part)


def check_anthropic_tools(tools: Any) -> None:
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind not in (None, "custom"):
            raise unsupported(f"tools.{i}.type", f"{kind!r}: {SERVER_TOOL.reason}")
        if isinstance(tool, Mapping) and tool.get("strict"):
            raise unsupported(f"tools.{i}.strict", NEEDS_GRAMMAR)


def _check_type(path: str, table: Mapping[str, Status], item: Any) -> None:
    if isinstance(item, Mapping):
        _check_value(path, table, item.get("type"))


def _check_value(path: str, table: Mapping[str, Status], value: Any) -> None:
    status = table.get(value) if isinstance(value, str) else None
    if status is None:
        if isinstance(value, str):
            raise unsupported(path, f"unknown value {value!r}")
        return  # missing or not a string: the schema refuses it
    if type(status) is Unsupported:
        raise unsupported(path, f"{value!r}: {status.reason}")


# -- the docs/api.md table ---------------------------------------------------------------------------------------------

ENDPOINT_TABLES: dict[str, Mapping[str, Status]] = {
    "POST /v1/chat/completions": CHAT_FIELDS,
    "POST /v1/completions": COMPLETION_FIELDS,
    "POST /v1/messages": MESSAGES_FIELDS,
    "POST /v1/messages/count_tokens": COUNT_TOKENS_FIELDS,
}
VALUE_TABLES: dict[str, Mapping[str, Status]] = {
    "chat `messages[].role`": OPENAI_ROLES,
    "chat `messages[].content[].type`": OPENAI_PART_TYPES,
    "chat `tools[].type`": OPENAI_TOOL_TYPES,
    "messages `messages[].role`": ANTHROPIC_ROLES,
    "messages `messages[].content[].type`": ANTHROPIC_BLOCK_TYPES,
    "messages `tools[].type`": {"custom": ANTHROPIC_CUSTOM_TOOL, "(server tools, e.g. web_search_*)": SERVER_TOOL},
}


def describe(status: Status) -> str:
    if type(status) is Supported:
        return "supported" + (f": {status.note}" if status.note else "")
    if type(status) is Unsupported:
        return f"400: {status.reason}"
    return f"partly: {status.note}; other values 400"


def markdown_table() -> str:
    """docs/api.md's table of every field, generated from the tables above."""
    lines = ["| where | field or value | status |", "| --- | --- | --- |"]
    for where, table in {**ENDPOINT_TABLES, **VALUE_TABLES}.items():
        if table is COUNT_TOKENS_FIELDS:
            lines.append(f"| {where} | {', '.join(f'`{n}`' for n in table)} | as on `POST /v1/messages` |")
            continue
        lines += [f"| {where if i == 0 else ''} | `{name}` | {describe(status)} |"
                  for i, (name, status) in enumerate(table.items())]
    return "\n".join(lines) + "\n"


def check_chat(document: Mapping[str, Any]) -> None:
    check_fields(CHAT_FIELDS, document)
    check_openai_messages(document.get("messages"))
    check_openai_tools(document.get("tools"))


def check_completion(document: Mapping[str, Any]) -> None:
    check_fields(COMPLETION_FIELDS, document)


def check_messages(document: Mapping[str, Any]) -> None:
    check_fields(MESSAGES_FIELDS, document)
    check_anthropic_messages(document.get("messages"))
    check_anthropic_tools(document.get("tools"))


def check_count_tokens(document: Mapping[str, Any]) -> None:
    check_fields(COUNT_TOKENS_FIELDS, document)
    check_anthropic_messages(document.get("messages"))
    check_anthropic_tools(document.get("tools"))
