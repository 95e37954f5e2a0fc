"""Request body of POST /v1/messages (the Anthropic Messages API, text only)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flotilla.gateway.schema_base import RequestModel
from flotilla.gateway.structured_params import OutputConfig


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class InputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @property
    def text(self) -> str:
        return _text(self.content)


class Metadata(RequestModel):
    user_id: str | None = None


class MessagesRequest(RequestModel):
    model: str | None = None  # required by Anthropic; here the gateway's default model fills in
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None  # its `format`: structured output (structured_params.py)

    @property
    def system_text(self) -> str | None:
        return None if self.system is None else _text(self.system)


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)
