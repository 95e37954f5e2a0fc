"""Async streaming client for any OpenAI-compatible /v1/chat/completions: sends each RequestSpec at its
arrival time (or as soon as a concurrency slot frees), times every streamed chunk, and never raises for a
failed request: the failure is a result with its reason (HTTP status or transport error).

aiohttp, as vLLM's own benchmark client: the client shares the CPU with the server under test, and aiohttp
spends about half of httpx's CPU time per streamed chunk."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from loadtest.serving.workload import RequestSpec


@dataclass(frozen=True)
class Endpoint:
    name: str  # label in reports (A/B)
    base_url: str  # ending in /v1
    model: str
    api_key: str = ""
    ignore_eos: bool = False  # vLLM honours it (exact output lengths); Flotilla's gateway ignores unknown fields
    use_tenant_keys: bool = True  # send each tenant's own key (False: always api_key, e.g. a B endpoint)


@dataclass
class RequestResult:
    index: int
    tier: str
    tenant: str
    kind: str
    sent_s: float  # offset from the start of the run
    ok: bool = False
    error: str = ""  # HTTP status ("429", "529", ...) or a transport error name
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks after the first
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)  # run offsets of content chunks (throughput plot)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RunResult:
    endpoint: str
    results: list[RequestResult]
    duration_s: float
    max_concurrency: int | None
    rate: float


async def run_workload(endpoint: Endpoint, specs: Sequence[RequestSpec], max_concurrency: int | None = None,
                       progress: bool = True, timeout_s: float = 600.0) -> RunResult:
    connector = aiohttp.TCPConnector(limit=max_concurrency or 1000)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc=endpoint.name, unit="req", disable=not progress, leave=False)
    async with aiohttp.ClientSession(endpoint.base_url.rstrip("/") + "/", connector=connector,
                                     timeout=timeout) as client:
        start = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            delay = spec.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)  # the workload's arrival schedule, not a wait for a condition
            if slots is None:
                result = await send(client, endpoint, spec, start)
            else:
                async with slots:
                    result = await send(client, endpoint, spec, start)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(spec) for spec in specs))
        duration = time.perf_counter() - start
    bar.close()
    rate = math.inf if not specs or specs[-1].arrival_s == 0 else len(specs) / specs[-1].arrival_s
    return RunResult(endpoint.name, list(results), duration, max_concurrency, rate)


async def send(client: aiohttp.ClientSession, endpoint: Endpoint, spec: RequestSpec, start: float) -> RequestResult:
    sent = time.perf_counter()
    result = RequestResult(spec.index, spec.tier, spec.tenant, spec.kind, sent - start)
    body = {"model": endpoint.model, "messages": list(spec.messages), "max_tokens": spec.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    key = spec.api_key if endpoint.use_tenant_keys and spec.api_key else endpoint.api_key
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with client.post("chat/completions", json=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                result.error = str(response.status)
                return result
            await _read_stream(response, result, sent, start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        result.error = type(err).__name__
    return result


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult, sent: float, start: float) -> None:
    num_chunks, last = 0, None
    async with aclosing(_sse_data(response)) as payloads:
        async for payload in payloads:
            event = json.loads(payload)
            if event.get("error"):
                result.error = "stream_error"
                return
            if event.get("usage"):
                result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                result.output_tokens = event["usage"].get("completion_tokens", 0)
            if any((c.get("delta") or {}).get("content") for c in event.get("choices", ())):
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last = now
                num_chunks += 1
                result.chunk_times_s.append(now - start)
    result.e2e_s = time.perf_counter() - sent
    result.output_tokens = result.output_tokens or num_chunks  # without usage: one token per chunk
    result.ok = result.ttft_s is not None or result.output_tokens == 0


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each SSE event as it arrives, until `[DONE]`; comments (pings) and events without data are
    skipped. Whatever bytes have arrived are split into events here: reading line by line costs the client
    about a third more CPU per event, and the client shares the machine with the server under test."""
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        if b"\r" in pending:  # servers may end lines with \r\n (one may be split across two reads)
            pending = pending.replace(b"\r\n", b"\n")
        *blocks, pending = pending.split(b"\n\n")
        for block in blocks:
            payload = _data_of(block)
            if payload == b"[DONE]":
                return
            if payload is not None:
                yield payload


def _data_of(block: bytes) -> bytes | None:
    """The data of one SSE event block (its `data:` lines joined), None if it has none."""
    lines = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
