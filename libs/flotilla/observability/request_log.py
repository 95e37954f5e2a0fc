"""One structured JSON log record per request and service, with stage timings and the trace id.

Records go to the `flotilla.requests` logger; `configure_request_log()` (called by the service entry points)
gives it a JSON handler on stderr and keeps it out of the text log format of the root logger.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

from pythonjsonlogger.json import JsonFormatter

LOGGER_NAME = "flotilla.requests"
_logger = logging.getLogger(LOGGER_NAME)


def configure_request_log(stream: TextIO | None = None) -> logging.Handler:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter("%(asctime)s %(message)s", rename_fields={"asctime": "time"},
                                       timestamp=False))
    _logger.addHandler(handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False
    return handler


def log_request(service: str, request_id: str, **fields: Any) -> None:
    """`fields`: stage timings in seconds (`*_s`, rounded to 0.1 ms), counts, outcome, trace_id, ..."""
    record = {"service": service, "request_id": request_id}
    for key, value in fields.items():
        record[key] = round(value, 4) if isinstance(value, float) else value
    _logger.info("request", extra=record)
