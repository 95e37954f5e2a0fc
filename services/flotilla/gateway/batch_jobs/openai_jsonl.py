"""OpenAI's batch JSONL: the input file's lines (checked while the job is `validating`) and the output and
error files written while it is `finalizing`."""

from __future__ import annotations

import json

from flotilla.gateway.batch_jobs.records import CANCELED, SUCCEEDED, BatchJob, ItemResult

MAX_REPORTED_ERRORS = 100
_NOT_RUN = {CANCELED: ("batch_cancelled", "This request was not executed because the batch was cancelled."),
            "expired": ("batch_expired",
                        "This request could not be executed before the completion window expired.")}


def parse_input(content: bytes, endpoint: str, max_requests: int, max_line_bytes: int) -> tuple[list[dict], list]:
    """(items as {custom_id, body}, errors as OpenAI's batch errors: code, message, param, line)."""
    items: list[dict] = []
    errors: list[dict] = []
    seen: set[str] = set()

    def error(code: str, message: str, line: int, param: str | None = None) -> None:
        if len(errors) < MAX_REPORTED_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            error("line_too_large", f"line {number} is over {max_line_bytes} bytes", number)
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            error("invalid_json_line", f"line {number} is not valid JSON", number)
            continue
        if not isinstance(line, dict):
            error("invalid_json_line", f"line {number} is not a JSON object", number)
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            error("missing_required_parameter", "custom_id must be a non-empty string", number, "custom_id")
        elif custom_id in seen:
            error("duplicate_custom_id", f"custom_id {custom_id!r} is used more than once", number, "custom_id")
        if line.get("method") != "POST":
            error("invalid_method", "method must be POST", number, "method")
        if line.get("url") != endpoint:
            error("mismatched_endpoint", f"url must be the batch's endpoint {endpoint}", number, "url")
        if not isinstance(line.get("body"), dict):
            error("invalid_body", "body must be a JSON object", number, "body")
        if isinstance(custom_id, str):
            seen.add(custom_id)
        items.append({"custom_id": custom_id, "body": line.get("body")})
    if not items and not errors:
        error("empty_file", "the input file has no requests", 1)
    if len(items) > max_requests:
        error("too_many_requests", f"the input file has {len(items)} requests; the limit is {max_requests}", None)
    return items, errors


def output_lines(job: BatchJob, items: list[dict], results: dict[int, ItemResult]) -> tuple[bytes, bytes]:
    """(output file, error file): answered requests by item order, 2xx in the first, the rest in the second."""
    output, errors = [], []
    for index in sorted(results):
        result = results[index]
        line = {"id": f"batch_req_{job.id.removeprefix('batch_')}_{index}",
                "custom_id": items[index]["custom_id"], "response": None, "error": None}
        if result.type in _NOT_RUN:
            code, message = _NOT_RUN[result.type]
            line["error"] = {"code": code, "message": message}
        else:
            line["response"] = {"status_code": result.status_code, "request_id": result.request_id,
                                "body": result.body}
        (output if result.type == SUCCEEDED else errors).append(json.dumps(line, separators=(",", ":")) + "\n")
    return "".join(output).encode(), "".join(errors).encode()
