"""A small SSE client for the OpenAI completions stream: text, usage, event ids, reconnects."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

from tests.support.fleet import MODEL


@dataclass
class StreamResult:
    text: str = ""
    num_chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: dict | None = None
    event_ids: list[str] = field(default_factory=list)
    done: bool = False
    request_id: str = ""

    def absorb(self, data: str) -> None:
        if data == "[DONE]":
            self.done = True
            return
        payload = json.loads(data)
        if "error" in payload:
            self.error = payload["error"]
            return
        for choice in payload.get("choices", []):
            self.text += choice.get("text", "")
            self.num_chunks += bool(choice.get("text"))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if payload.get("usage"):
            self.completion_tokens = payload["usage"]["completion_tokens"]
            self.prompt_tokens = payload["usage"]["prompt_tokens"]


def completion_body(prompt: list[int], max_tokens: int, seed: int | None = None, stream: bool = True,
                    top_k: int = 0) -> dict:
    """Greedy, or with a seed sampled at temperature 0.8 (and top_k, vLLM's extension, where given)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "temperature": 0.0 if seed is None else 0.8}
    if seed is not None:
        body["seed"] = seed
    if top_k:
        body["top_k"] = top_k
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def read_events(response: httpx.Response, result: StreamResult, on_event=None) -> None:
    """Feed every SSE event of a response into `result`; on_event(result) after each one."""
    event_id, data = None, []
    async for line in response.aiter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            if event_id is not None:
                result.event_ids.append(event_id)
            result.absorb("\n".join(data))
            event_id, data = None, []
            if on_event is not None:
                await on_event(result)


async def stream_completion(client: httpx.AsyncClient, url: str, headers: dict, body: dict,
                            on_event=None) -> StreamResult:
    result = StreamResult()
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            result.error = {"status": response.status_code, **json.loads(await response.aread())}
            return result
        await read_events(response, result, on_event)
    return result
