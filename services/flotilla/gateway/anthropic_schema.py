"""Request bodies of POST /v1/messages and POST /v1/messages/count_tokens (the Anthropic Messages API: text,
custom tools). What each field does is in field_support.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from flotilla.gateway.schema_base import MAX_CONTENT_BLOCKS, MAX_MESSAGES, MAX_TOOLS, RequestModel
from flotilla.gateway.structured_params import OutputFormat


class CacheControl(RequestModel):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # the prefix cache is automatic
    citations: None = None


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: None = None


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_BLOCKS)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        text = _text(self.content or "")
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_CONTENT_BLOCKS)]


class Metadata(RequestModel):
    user_id: str | None = None


class Tool(RequestModel):
    name: str = Field(min_length=1)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # true is refused (field_support.py)


class ToolChoice(RequestModel):
    type: Literal["auto", "none", "any", "tool"]  # any / tool: a call is forced (tool_grammar.py)
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputConfig(RequestModel):
    effort: str | None = None
    format: OutputFormat | None = None  # structured output (structured_params.py)


class PromptParams(RequestModel):
    """What makes the prompt: the fields count_tokens takes as well."""

    model: str | None = None  # required by Anthropic; here the gateway's default model fills in
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_BLOCKS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"} gets here
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the beta name of output_config.format
    cache_control: CacheControl | None = None
    speed: Literal["standard"] | None = None

    @property
    def system_text(self) -> str | None:
        return None if self.system is None else _text(self.system)

    @property
    def forced_tool(self) -> tuple[bool, str | None]:
        """(a call is required, the one tool it must call or None for any)."""
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return False, None
        return True, choice.name if choice.type == "tool" else None

    @property
    def single_tool_call(self) -> bool:
        return self.tool_choice is not None and bool(self.tool_choice.disable_parallel_tool_use)

    @property
    def active_tools(self) -> list[Tool]:
        """The tools the model is shown: none with tool_choice none."""
        if self.tool_choice is not None and self.tool_choice.type == "none":
            return []
        return self.tools or []


class CountTokensRequest(PromptParams):
    pass


class MessagesRequest(PromptParams):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)
