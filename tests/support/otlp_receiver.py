"""A small OTLP/HTTP trace receiver on a free loopback port: decodes ExportTraceServiceRequest protobufs
POSTed to /v1/traces and keeps every span, for tests that check what real processes exported."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict[str, object]


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_exports = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._add(body if self.path == "/v1/traces" else None)
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, predicate, timeout_s: float) -> bool:
        """Until predicate(spans) holds (re-checked on every export) or the deadline passes."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(list(self.spans)), timeout=timeout_s)

    def _add(self, body: bytes | None) -> None:
        if body is None:
            return
        request = ExportTraceServiceRequest.FromString(body)
        spans = [_span(resource, span) for resource in request.resource_spans
                 for scope in resource.scope_spans for span in scope.spans]
        with self._changed:
            self.spans.extend(spans)
            self.num_exports += 1
            self._changed.notify_all()


def _span(resource_spans, span) -> ReceivedSpan:
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    attributes = {a.key: _value(a.value) for a in span.attributes}
    return ReceivedSpan(resource.get("service.name", ""), span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), attributes)


def _value(value) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
