"""A moderation classifier for tests: real HTTP on loopback, the OpenAI moderation shape (`POST /v1/moderations`
with `input`, answered `results[].flagged/categories`). It flags a text containing one of `flagged_words`
(category "test-flag"); `delay_s` makes it slow and `fail_status` makes it fail (only for calls with a text
containing one of `trouble_words`, when that is set); `inputs` records each call's inputs."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CATEGORY = "test-flag"


class ModerationServer:
    def __init__(self) -> None:
        self.flagged_words: set[str] = set()
        self.delay_s = 0.0
        self.fail_status = 0
        self.trouble_words: set[str] = set()
        self.inputs: list[list[str]] = []  # one list per call
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="moderation-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1/moderations"

    def start(self) -> ModerationServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def reset(self) -> None:
        self.flagged_words, self.delay_s, self.fail_status, self.inputs = set(), 0.0, 0, []
        self.trouble_words = set()

    def troubled(self, texts: list[str]) -> bool:
        return not self.trouble_words or any(w in text.lower() for w in self.trouble_words for text in texts)

    def results(self, texts: list[str]) -> list[dict]:
        self.inputs.append(texts)
        return [self._result(text) for text in texts]

    def _result(self, text: str) -> dict:
        flagged = any(word in text.lower() for word in self.flagged_words)
        return {"flagged": flagged, "categories": {CATEGORY: flagged}, "category_scores": {CATEGORY: float(flagged)}}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
                troubled = server.troubled(texts)
                time.sleep(server.delay_s if troubled else 0.0)
                status, answer = (server.fail_status, {"error": "failing on purpose"}) if server.fail_status and troubled \
                    else (200, {"id": "modr-test", "model": "test", "results": server.results(texts)})
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the gateway gave up waiting (a slow-classifier test)

            def log_message(self, *args) -> None:
                pass

        return Handler
