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

# Under text/event-stream an OpenAPI 3.1 `schema` describes each event (3.2 has itemSchema for that).
SSE = _object({"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"},
               "retry": _INT}, required=["data"])
SSE["description"] = "Server-sent events: the dialect's stream events, then its end"

# Batch jobs (batch_jobs/): OpenAI's File and Batch objects, Anthropic's MessageBatch.
FILE = _object({
    "id": {"type": "string"}, "object": {"const": "file"}, "bytes": _INT, "created_at": _INT,
    "filename": {"type": "string"}, "purpose": {"enum": ["batch", "batch_output"]}, "status": {"const": "processed"},
    "status_details": {"type": "null"}, "expires_at": {"type": "null"}}, closed=True)

FILE_LIST = _object({"object": {"const": "list"}, "data": {"type": "array", "items": FILE},
                     "first_id": _NULLABLE_STRING, "last_id": _NULLABLE_STRING, "has_more": {"type": "boolean"}},
                    closed=True)

FILE_DELETED = _object({"id": {"type": "string"}, "object": {"const": "file"}, "deleted": {"type": "boolean"}},
                       closed=True)

JSONL = {"type": "string", "description": "JSON Lines: one JSON object per line"}

_NULLABLE_INT = {"type": ["integer", "null"]}
_LINE_ERROR = _object({"code": _NULLABLE_STRING, "message": {"type": "string"}, "param": _NULLABLE_STRING,
                       "line": _NULLABLE_INT}, required=["message"])
BATCH = _object({
    "id": {"type": "string"}, "object": {"const": "batch"},
    "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]}, "model": {"type": "null"},
    "errors": {"anyOf": [{"type": "null"}, _object({"object": {"const": "list"},
                                                    "data": {"type": "array", "items": _LINE_ERROR}})]},
    "input_file_id": {"type": "string"}, "completion_window": {"const": "24h"},
    "status": {"enum": ["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                        "cancelled"]},
    "output_file_id": _NULLABLE_STRING, "error_file_id": _NULLABLE_STRING, "created_at": _INT, "expires_at": _INT,
    **{f"{status}_at": _NULLABLE_INT for status in ("in_progress", "finalizing", "completed", "failed", "expired",
                                                    "cancelling", "cancelled")},
    "request_counts": _object({"total": _INT, "completed": _INT, "failed": _INT}, closed=True),
    "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
}, closed=True)

BATCH_LIST = _object({"object": {"const": "list"}, "data": {"type": "array", "items": BATCH},
                      "first_id": _NULLABLE_STRING, "last_id": _NULLABLE_STRING, "has_more": {"type": "boolean"}},
                     closed=True)

_TIMESTAMP = {"type": "string", "format": "date-time"}
_NULLABLE_TIMESTAMP = {"anyOf": [_TIMESTAMP, {"type": "null"}]}
MESSAGE_BATCH = _object({
    "id": {"type": "string"}, "type": {"const": "message_batch"},
    "processing_status": {"enum": ["in_progress", "canceling", "ended"]},
    "request_counts": _object({"processing": _INT, "succeeded": _INT, "errored": _INT, "canceled": _INT,
                               "expired": _INT}, closed=True),
    "ended_at": _NULLABLE_TIMESTAMP, "created_at": _TIMESTAMP, "expires_at": _TIMESTAMP,
    "archived_at": {"type": "null"}, "cancel_initiated_at": _NULLABLE_TIMESTAMP, "results_url": _NULLABLE_STRING,
}, closed=True)

MESSAGE_BATCH_LIST = _object({"data": {"type": "array", "items": MESSAGE_BATCH}, "has_more": {"type": "boolean"},
                              "first_id": _NULLABLE_STRING, "last_id": _NULLABLE_STRING}, closed=True)

MESSAGE_BATCH_RESULTS = {"type": "string", "description": "JSON Lines, one per request in order: {\"custom_id\", "
                         "\"result\": {\"type\": \"succeeded\", \"message\"} | {\"type\": \"errored\", \"error\"} | "
                         "{\"type\": \"canceled\"} | {\"type\": \"expired\"}}"}

FILE_UPLOAD = _object({
    "purpose": {"const": "batch", "description": "the only purpose this API keeps"},
    "file": {"type": "string", "format": "binary", "description": "UTF-8 JSONL: one request per line, within "
             "the gateway's --batch-* limits of bytes, lines and bytes per line"}})
