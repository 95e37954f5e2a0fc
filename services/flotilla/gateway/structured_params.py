"""Request fields that ask for structured output, in both dialects, and the one engine spec they become.

OpenAI: `response_format` (`text`, `json_object`, `json_schema` as `chat.completions.parse` sends it) and
vLLM's extensions (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and the newer
`structured_outputs` object with the same four). Anthropic: `output_config.format` (`json_schema`, what
`messages.parse(output_format=...)` sends; `output_format` is its beta name). A request names at most one of these; the spec is compiled here
(cached) so that a bad schema is a 400 naming the request's own field before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from flotilla.engine.errors import InvalidRequestError
from flotilla.engine.structured_output import StructuredOutput, any_json_object, compile_grammar
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.schema_base import RequestModel


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar always enforces the schema: strict or not, the output validates


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(RequestModel):
    """vLLM's `structured_outputs` object: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class GuidedParams(RequestModel):
    """The OpenAI dialect's structured-output fields (mixed into its request models)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def structured_output(self) -> StructuredOutput | None:
        candidates: list[tuple[str, StructuredOutput]] = []
        if self.response_format is not None and self.response_format.type != "text":
            candidates.append(("response_format", _response_format(self.response_format)))
        vllm = [("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
                ("guided_choice", "choice", self.guided_choice), ("guided_grammar", "grammar", self.guided_grammar)]
        if self.structured_outputs is not None:
            nested = self.structured_outputs
            vllm += [("structured_outputs.json", "json", nested.json_), ("structured_outputs.regex", "regex", nested.regex),
                     ("structured_outputs.choice", "choice", nested.choice),
                     ("structured_outputs.grammar", "grammar", nested.grammar)]
        candidates += [(name, _spec(kind, value)) for name, kind, value in vllm if value is not None]
        return _one(candidates)


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


def anthropic_structured_output(output_config_format: OutputFormat | None,
                                output_format: OutputFormat | None) -> StructuredOutput | None:
    """`output_config.format`, or its beta name `output_format`."""
    named = [("output_config.format", output_config_format), ("output_format", output_format)]
    return _one([(name, StructuredOutput("json", json.dumps(value.schema_))) for name, value in named if value])


def _response_format(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return any_json_object()
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "response_format.json_schema.schema is required for type "
                           "json_schema", param="response_format")
    return StructuredOutput("json", json.dumps(response_format.json_schema.schema_))


def _spec(kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(value))
    return StructuredOutput(kind, value)  # type: ignore[arg-type]


def _one(candidates: list[tuple[str, StructuredOutput]]) -> StructuredOutput | None:
    if len(candidates) > 1:
        names = ", ".join(name for name, _ in candidates)
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"only one structured output may be asked for, got {names}",
                           param=candidates[1][0])
    if not candidates:
        return None
    field, spec = candidates[0]
    try:
        compile_grammar(spec)
    except InvalidRequestError as err:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"{field}: {err.message}", param=field) from err
    return spec
