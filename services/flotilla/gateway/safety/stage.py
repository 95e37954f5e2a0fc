"""The safety stage in the request path: the prompt screened before admission, the answer through
ScreenedEvents.

ScreenedEvents sits between the router stream (generation.RouterEvents) and the dialect: it feeds each
chunk's text to the output screen and passes on, whole, only the chunks the screen cleared (so token ids and
logprobs stay with their text); the others wait. On a block the held chunks are dropped, the router stream
ends on a Filtered event (every tap sees it: the ledger records `filtered`, quota keeps the delivered tokens)
and its call is cancelled, so the engine aborts the request at once. However else the stream ends (the client
gone, a router error), the router stream's taps are told how many relayed tokens were still held (Withheld):
they were never sent, so they are not billed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from flotilla.gateway.auth import Principal
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.generation import RouterEvents
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.safety.config import SafetyConfig
from flotilla.gateway.safety.filtered import Filtered, blocked_error
from flotilla.gateway.safety.policy import SafetyPolicy
from flotilla.gateway.safety.rules import PolicyError
from flotilla.gateway.safety.verdict import ALLOW, OutputScreen, Verdict
from flotilla.rpc.stream_events import Chunk, Finished, Usage


def policy_for(config: SafetyConfig | None, principal: Principal) -> SafetyPolicy | None:
    if config is None:
        return None
    try:
        return config.policy(principal.safety_policy)
    except PolicyError as err:  # a key naming a policy this gateway lacks: refused, never unscreened
        raise GatewayError(ErrorKind.INTERNAL, str(err), code="safety_policy_unknown") from None


async def screen_prompt(config: SafetyConfig | None, metrics: GatewayMetrics, principal: Principal, tokenizer,
                        prompt_ids: Sequence[int]) -> SafetyPolicy | None:
    """The request's policy, once its prompt passed it (as the model will read it: the tokens, decoded);
    a blocked prompt is a 400 with code content_filter (503 when a failing classifier fails closed)."""
    policy = policy_for(config, principal)
    if policy is None:
        return None
    text = await asyncio.to_thread(tokenizer.decode, list(prompt_ids))
    verdict = await policy.screen_input(text)
    if not verdict.allowed:
        count_block(metrics, "input", policy.name, verdict)
        raise blocked_error("the prompt", verdict)
    return policy


def count_block(metrics: GatewayMetrics, stage: str, policy: str, verdict: Verdict) -> None:
    metrics.safety_blocks.labels(stage, policy, verdict.category).inc()


def screened(events: RouterEvents, policy: SafetyPolicy | None, metrics: GatewayMetrics,
             num_prompt_tokens: int) -> RouterEvents | ScreenedEvents:
    screen = policy.output_screen() if policy is not None else None
    if screen is None:
        return events
    return ScreenedEvents(events, screen, lambda v: count_block(metrics, "output", policy.name, v), num_prompt_tokens)


class ScreenedEvents:
    """Chunks the screen cleared, then Finished, or Filtered after a block (see the module's docstring)."""

    def __init__(self, events: RouterEvents, screen: OutputScreen, on_block, num_prompt_tokens: int):
        self._events = events
        self._screen = screen
        self._on_block = on_block
        self._num_prompt_tokens = num_prompt_tokens
        self._held: deque[tuple[int, Chunk]] = deque()  # (text offset of its end, chunk), not yet cleared
        self._ready: deque[Chunk | Finished | Filtered] = deque()
        self._num_chars = 0
        self.num_delivered_tokens = 0
        self._done = False

    def __aiter__(self) -> ScreenedEvents:
        return self

    async def __anext__(self) -> Chunk | Finished | Filtered:
        while not self._ready:
            if self._done:
                raise StopAsyncIteration
            event = await self._events.__anext__()
            if type(event) is Chunk:
                self._num_chars += len(event.text)
                self._held.append((self._num_chars, event))
                self._events.num_withheld_tokens += len(event.token_ids)
                verdict = await self._screen.feed(event.text) if event.text else ALLOW
            else:
                verdict = await self._screen.finish()
            if not verdict.allowed:
                return await self._block(verdict)
            self._release()
            if type(event) is not Chunk:
                self._ready.append(event)
                self._done = True
        return self._ready.popleft()

    async def aclose(self) -> None:
        self._done = True
        await self._events.aclose()

    def _release(self) -> None:
        """Moves the cleared chunks to `_ready`, as one chunk: tokens that are ready together go out as one
        event, as the router stream's do (each event costs CPU on the way out)."""
        cleared, held = self._screen.cleared, self._held
        released = []
        while held and held[0][0] <= cleared:
            released.append(held.popleft()[1])
        if not released:
            return
        chunk = released[0] if len(released) == 1 else _joined(released)
        self.num_delivered_tokens += len(chunk.token_ids)
        self._events.num_withheld_tokens -= len(chunk.token_ids)
        self._ready.append(chunk)

    async def _block(self, verdict: Verdict) -> Filtered:
        self._done = True
        self._held.clear()  # held back: never sent (Filtered says what was)
        self._events.num_withheld_tokens = 0
        self._on_block(verdict)
        filtered = Filtered(verdict, Usage(self._num_prompt_tokens, self.num_delivered_tokens, 0))
        await self._events.end_with(filtered)
        return filtered


def _joined(chunks: list[Chunk]) -> Chunk:
    return Chunk(tuple(t for c in chunks for t in c.token_ids), "".join(c.text for c in chunks),
                 tuple(lp for c in chunks for lp in c.logprobs))
