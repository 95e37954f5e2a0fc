"""Every request field of both dialects has a status (field_support.py): the installed SDKs' request types are walked
so a field added to a dialect cannot be dropped silently; the tables agree with the schemas and docs/api.md."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from flotilla.gateway import field_support as fs
from flotilla.gateway.anthropic_schema import CountTokensRequest, MessagesRequest
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.openai_schema import ChatCompletionRequest, CompletionRequest


API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"  # the user manual's field table


def _keys(typed_dict: type) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def _literals(annotation) -> set:
    """Every Literal value inside an annotation (through Required, Optional, Union, Annotated)."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    return {value for arg in typing.get_args(annotation) for value in _literals(arg)}


def _member_literals(union, field: str) -> set:
    return {value for member in typing.get_args(union)
            for value in _literals(typing.get_type_hints(member, include_extras=True)[field])}


def _sdk_request_types():
    from anthropic.types import message_count_tokens_params, message_create_params
    from anthropic.types.beta import message_count_tokens_params as beta_count, message_create_params as beta_create
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    return [
        ("chat", chat_create_params.CompletionCreateParamsStreaming, fs.CHAT_FIELDS),
        ("chat", chat_create_params.CompletionCreateParamsNonStreaming, fs.CHAT_FIELDS),
        ("completions", completion_create_params.CompletionCreateParamsStreaming, fs.COMPLETION_FIELDS),
        ("completions", completion_create_params.CompletionCreateParamsNonStreaming, fs.COMPLETION_FIELDS),
        ("messages", message_create_params.MessageCreateParamsStreaming, fs.MESSAGES_FIELDS),
        ("messages", message_create_params.MessageCreateParamsNonStreaming, fs.MESSAGES_FIELDS),
        ("messages (beta)", beta_create.MessageCreateParamsStreaming, fs.MESSAGES_FIELDS),
        ("count_tokens", message_count_tokens_params.MessageCountTokensParams, fs.COUNT_TOKENS_FIELDS),
        ("count_tokens (beta)", beta_count.MessageCountTokensParams, fs.COUNT_TOKENS_FIELDS),
    ]


@pytest.mark.parametrize("name,typed_dict,table", _sdk_request_types(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_sdk_request_field_has_a_status(name, typed_dict, table):
    missing = _keys(typed_dict) - set(table)
    assert not missing, f"{name}: fields of {typed_dict.__module__}.{typed_dict.__name__} not in field_support.py"


def test_every_sdk_role_and_content_type_has_a_status():
    import anthropic.types as at
    import openai.types.chat as oc

    assert _member_literals(oc.ChatCompletionMessageParam, "role") <= set(fs.OPENAI_ROLES)
    parts = oc.ChatCompletionContentPartParam
    assert _member_literals(parts, "type") | {"refusal"} <= set(fs.OPENAI_PART_TYPES)
    assert _member_literals(oc.ChatCompletionToolUnionParam, "type") <= set(fs.OPENAI_TOOL_TYPES)
    assert _member_literals(at.MessageParam, "role") <= set(fs.ANTHROPIC_ROLES)
    assert _member_literals(at.ContentBlockParam, "type") - {"server_tool_use", "web_search_tool_result",
                                                             "web_fetch_tool_result", "code_execution_tool_result",
                                                             "bash_code_execution_tool_result",
                                                             "text_editor_code_execution_tool_result",
                                                             "tool_search_tool_result"} <= set(fs.ANTHROPIC_BLOCK_TYPES)


def test_every_sdk_content_block_type_is_handled_or_refused():
    """Block types of server tools have no row of their own: they are refused as unknown values, naming them."""
    import anthropic.types as at

    for kind in _member_literals(at.ContentBlockParam, "type"):
        messages = [{"role": "user", "content": [{"type": kind}]}]
        status = fs.ANTHROPIC_BLOCK_TYPES.get(kind)
        if status is not None and type(status) is fs.Supported:
            fs.check_anthropic_messages(messages)
        else:
            with pytest.raises(GatewayError, match=f"messages.0.content.0.type is not supported: .*{kind}"):
                fs.check_anthropic_messages(messages)


def test_every_sdk_server_tool_is_refused_and_custom_tools_pass():
    import anthropic.types as at

    kinds = _member_literals(at.ToolUnionParam, "type")
    assert "custom" in kinds and len(kinds) > 10
    for kind in kinds - {"custom"}:
        with pytest.raises(GatewayError, match="tools.0.type is not supported"):
            fs.check_anthropic_tools([{"type": kind, "name": "x"}])
    fs.check_anthropic_tools([{"type": "custom", "name": "x", "input_schema": {}}, {"name": "y", "input_schema": {}}])


@pytest.mark.parametrize("table,schema", [(fs.CHAT_FIELDS, ChatCompletionRequest),
                                          (fs.COMPLETION_FIELDS, CompletionRequest),
                                          (fs.MESSAGES_FIELDS, MessagesRequest),
                                          (fs.COUNT_TOKENS_FIELDS, CountTokensRequest)])
def test_tables_and_schemas_agree(table, schema):
    """A field that may pass the table is one the schema reads; every field the schema reads has a row."""
    readable = {name for name, status in table.items() if type(status) is not fs.Unsupported}
    assert readable <= set(schema.model_fields), readable - set(schema.model_fields)
    assert set(schema.model_fields) <= set(table), set(schema.model_fields) - set(table)


def test_the_api_doc_holds_the_generated_table():
    readme = API_DOC.read_text()
    begin, end = "<!-- field-table:begin -->\n", "<!-- field-table:end -->"
    assert begin in readme and end in readme
    held = readme.split(begin, 1)[1].split(end, 1)[0]
    assert held == fs.markdown_table(), "docs/api.md's field table is stale: paste field_support.markdown_table()"


@pytest.mark.parametrize("document,field", [
    ({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"), ({"audio": {"voice": "x"}}, "audio"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"min_p": 0.1}, "min_p"),
])
def test_chat_refusals_name_the_field(document, field):
    with pytest.raises(GatewayError) as caught:
        fs.check_chat(document)
    assert caught.value.param == field and f"{field} is not supported" in caught.value.message


@pytest.mark.parametrize("document", [
    {"n": 1}, {"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}},
    {"guided_regex": "a+"}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"top_k": 5, "ignore_eos": True}, {"audio": None}, {"store": False}, {"presence_penalty": 0},
])
def test_chat_values_that_work_pass(document):
    fs.check_chat(document)


@pytest.mark.parametrize("document,field", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "tool_choice"),
    ({"output_config": {"effort": "high"}}, "output_config"), ({"mcp_servers": []}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
])
def test_messages_refusals_name_the_field(document, field):
    with pytest.raises(GatewayError) as caught:
        fs.check_messages(document)
    assert caught.value.param == field and f"{field} is not supported" in caught.value.message


@pytest.mark.parametrize("tool_choice", [[None, None], "auto", 3])
def test_a_tool_choice_of_the_wrong_type_is_left_to_the_schema(tool_choice):
    fs.check_messages({"tool_choice": tool_choice})  # no crash: MessagesRequest answers the 400
    fs.check_count_tokens({"tool_choice": tool_choice})


def test_structured_output_fields_pass_the_table():
    # What they ask for is checked by structured_params.py (a bad schema is a 400 naming the field).
    for document in ({"response_format": {"type": "json_schema", "json_schema": {}}}, {"guided_json": {}},
                     {"structured_outputs": {"regex": "a+"}}):
        fs.check_chat(document)
    fs.check_messages({"output_config": {"format": {"type": "json_schema"}}})
    fs.check_messages({"output_format": {"type": "json_schema"}})
