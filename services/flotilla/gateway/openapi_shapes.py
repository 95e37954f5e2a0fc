"""JSON Schemas of what the gateway answers (openapi.py puts them in /openapi.json): each dialect's error shape
and the success bodies the handlers build. Kept next to nothing else so that a change of a body's shape shows
here; tests/gateway/test_openapi.py and the schemathesis fuzz (tests/fleet/adversarial) hold the two together."""

from __future__ import annotations

from flotilla.gateway.errors import ErrorKind

_NULLABLE_STRING = {"type": ["string", "null"]}
_INT = {"type": "integer"}


def _object(properties: dict, required: list[str] | None = None, closed: bool = False) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties) if required is None
              else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


OPENAI_ERROR = _object({"error": _object({
    "message": {"type": "string"},
    "type": {"enum": sorted({kind.openai_type for kind in ErrorKind})},
    "param": _NULLABLE_STRING,
    "code": _NULLABLE_STRING,
}, closed=True)}, closed=True)

ANTHROPIC_ERROR = _object({
    "type": {"const": "error"},
    "error": _object({"type": {"enum": sorted({kind.anthropic_type for kind in ErrorKind})},
                      "message": {"type": "string"}}, closed=True),
}, closed=True)

_LOGPROBS = {"type": ["object", "null"]}
_OPENAI_USAGE = _object({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                         "prompt_tokens_details": _object({"cached_tokens": _INT})})


def _openai_answer(object_name: str, choice: dict) -> dict:
    return _object({"id": {"type": "string"}, "object": {"const": object_name}, "created": _INT,
                    "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                    "usage": _OPENAI_USAGE})


CHAT_COMPLETION = _openai_answer("chat.completion", _object({
    "index": _INT, "logprobs": _LOGPROBS, "finish_reason": _NULLABLE_STRING,
    "message": _object({"role": {"const": "assistant"}, "content": _NULLABLE_STRING,
                        "tool_calls": {"type": "array", "items": {"type": "object"}}}, required=["role"]),
}))

COMPLETION = _openai_answer("text_completion", _object({
    "index": _INT, "text": {"type": "string"}, "logprobs": _LOGPROBS, "finish_reason": _NULLABLE_STRING}))

MESSAGE = _object({
    "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
    "model": {"type": "string"},
    "content": {"type": "array", "items": _object({"type": {"enum": ["text", "tool_use"]}}, required=["type"])},
    "stop_reason": _NULLABLE_STRING, "stop_sequence": _NULLABLE_STRING,
    "usage": _object({"input_tokens": _INT, "cache_read_input_tokens": _INT, "output_tokens": _INT}),
})

COUNT_TOKENS = _object({"input_tokens": _INT}, closed=True)

BATCH_GENERATION = _object({
    "id": {"type": "string"}, "object": {"const": "batch_generation"}, "created": _INT,
    "model": {"type": "string"}, "output": {"type": "string"}, "batch": {"type": "object"},
})

MODERATION = _object({
    "id": {"type": "string"}, "model": {"type": "string"},
    "results": {"type": "array", "items": _object({
        "flagged": {"type": "boolean"},
        "categories": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "category_scores": {"type": "object", "additionalProperties": {"type": "number"}}})},
})

MODEL = _object({
    "id": {"type": "string"}, "object": {"const": "model"}, "created": _INT, "owned_by": {"type": "string"},
    "type": {"const": "model"}, "display_name": {"type": "string"}, "created_at": {"type": "string"},
    "max_model_len": _INT, "version": {"type": "string"}, "aliases": {"type": "array", "items": {"type": "string"}},
})

MODEL_LIST = _object({"object": {"const": "list"}, "data": {"type": "array", "items": MODEL},
                      "has_more": {"type": "boolean"}, "first_id": _NULLABLE_STRING, "last_id": _NULLABLE_STRING})

HEALTH = _object({"status": {"enum": ["ok", "ready", "degraded", "unavailable"]}}, )

SSE = {"type": "string", "description": "Server-sent events: the dialect's stream events, then its end"}
