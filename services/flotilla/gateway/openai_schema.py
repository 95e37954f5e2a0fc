"""Request bodies of POST /v1/chat/completions and POST /v1/completions (OpenAI-compatible: text, function tools).
What each field does is in field_support.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from flotilla.gateway.schema_base import (MAX_CONTENT_BLOCKS, MAX_MESSAGES, MAX_PROMPT_TOKEN_IDS, MAX_TOOLS,
                                           RequestModel)
from flotilla.gateway.structured_params import GuidedParams


class TextPart(RequestModel):
    type: Literal["text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: Any = None  # the prefix cache is automatic

    @property
    def value(self) -> str:
        return (self.text if self.type == "text" else self.refusal) or ""


class FunctionCall(RequestModel):
    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_BLOCKS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant: rendered as its text when there is no content

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or self.refusal or ""
        return "".join(part.value for part in self.content)


class StreamOptions(RequestModel):
    include_usage: bool = False


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true is refused (field_support.py)


class FunctionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str = Field(min_length=1)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class CommonParams(GuidedParams):
    """Fields shared by both endpoints (the structured-output ones from structured_params.py)."""

    model: str | None = None
    max_tokens: int | None = None  # our policy: required (max_completion_tokens counts as well)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # not OpenAI's, but vLLM-style clients send it
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension: exact output lengths (benchmarks compare like for like)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def forced_tool(self) -> tuple[bool, str | None]:
        """(a call is required, the one tool it must call or None for any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required", None

    @property
    def active_tools(self) -> list[FunctionTool]:
        """The tools the model is shown: none with tool_choice none."""
        return [] if self.tool_choice == "none" else (self.tools or [])


class CompletionRequest(CommonParams):
    prompt: (str | list[str] | Annotated[list[int], Field(max_length=MAX_PROMPT_TOKEN_IDS)]
             | list[Annotated[list[int], Field(max_length=MAX_PROMPT_TOKEN_IDS)]])
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
