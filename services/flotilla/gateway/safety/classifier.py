"""The external classifier policy: an OpenAI-compatible moderation endpoint over HTTP (`POST .../moderations`
with `{"input": [texts]}`, answered `{"results": [{"flagged", "categories": {name: bool}}]}`).

Texts asked for at about the same time (one engine step's worth of deltas from every open stream, and
prompts) go out as one request: the first text opens a batch, which is sent `batch_delay_s` later or once it
holds `max_batch` texts. Every call has a timeout; a classifier that is slow, down or answers nonsense is
`unavailable`, and the fail mode decides: "open" allows, "closed" blocks (category "unavailable").

For an answer the screen holds back text until `window_chars` of it are waiting (or the answer ends), then
judges the window with the window of text before it, so a call costs one round trip per window, not per token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from flotilla.gateway.safety.rules import PolicyError
from flotilla.gateway.safety.verdict import ALLOW, UNAVAILABLE_CATEGORY, Moderation, Verdict

log = logging.getLogger(__name__)
FAIL_MODES = ("open", "closed")


@dataclass(frozen=True)
class ClassifierSettings:
    url: str
    timeout_s: float = 2.0
    fail_mode: str = "closed"
    window_chars: int = 64
    max_batch: int = 32
    batch_delay_s: float = 0.002
    model: str = ""  # sent as "model" when set

    @classmethod
    def from_json(cls, item: object, where: str) -> ClassifierSettings:
        allowed = {"url", "timeout_s", "fail_mode", "window_chars", "max_batch", "batch_delay_s", "model"}
        if not isinstance(item, Mapping) or "url" not in item or not set(item) <= allowed:
            raise PolicyError(f"{where}: classifier needs url (optional: {sorted(allowed - {'url'})}), got {item!r}")
        try:
            return cls(**item)
        except (TypeError, ValueError) as err:
            raise PolicyError(f"{where}: {err}") from None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"classifier url must be http(s)://..., got {self.url!r}")
        if self.fail_mode not in FAIL_MODES:
            raise ValueError(f"fail_mode must be one of {FAIL_MODES}, got {self.fail_mode!r}")
        if not self.timeout_s > 0 or self.batch_delay_s < 0 or self.window_chars < 1 or self.max_batch < 1:
            raise ValueError("timeout_s must be > 0, batch_delay_s >= 0, window_chars and max_batch >= 1")


class ClassifierUnavailable(Exception):
    pass


class ClassifierClient:
    """One HTTP client per policy; `classify` joins the open batch."""

    def __init__(self, settings: ClassifierSettings):
        self.settings = settings
        self._http: httpx.AsyncClient | None = None  # made in the serving loop, at the first call
        self._batch: list[tuple[str, asyncio.Future]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task] = set()  # held: the loop keeps only weak references to tasks
        self.num_calls = 0

    async def classify(self, text: str) -> Moderation:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._batch.append((text, future))
        if len(self._batch) >= self.settings.max_batch:
            self._send_batch()
        elif self._flush is None:
            self._flush = loop.call_later(self.settings.batch_delay_s, self._send_batch)
        return await future

    def _send_batch(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        batch, self._batch = self._batch, []
        if batch:
            task = asyncio.ensure_future(self._call(batch))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        self.num_calls += 1
        try:
            results = await asyncio.wait_for(self._post([text for text, _ in batch]), self.settings.timeout_s)
        except Exception as err:  # noqa: BLE001 - timeout, refused connection, bad status or body: unavailable
            log.warning("safety classifier %s unavailable: %r", self.settings.url, err)
            for _, future in batch:
                if not future.done():
                    future.set_exception(ClassifierUnavailable(str(err) or type(err).__name__))
            return
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)

    async def _post(self, texts: list[str]) -> list[Moderation]:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.settings.timeout_s)
        body: dict = {"input": texts}
        if self.settings.model:
            body["model"] = self.settings.model
        response = await self._http.post(self.settings.url, json=body)
        response.raise_for_status()
        results = response.json()["results"]
        if not isinstance(results, list) or len(results) != len(texts):
            raise ValueError(f"expected {len(texts)} results, got {results!r:.200}")
        return [_moderation(result) for result in results]

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def _moderation(result: Mapping) -> Moderation:
    categories = result.get("categories") or {}
    if not isinstance(result.get("flagged"), bool) or not isinstance(categories, Mapping):
        raise ValueError(f"not a moderation result: {result!r:.200}")
    return Moderation(result["flagged"], {str(name): bool(value) for name, value in categories.items()})


class ClassifierPolicy:
    def __init__(self, settings: ClassifierSettings):
        self.settings = settings
        self.window_chars = settings.window_chars
        self.client = ClassifierClient(settings)

    async def screen_input(self, text: str) -> Verdict:
        return await self.judge(text)

    async def moderate(self, text: str) -> Moderation:
        return await self.client.classify(text)

    def output_screen(self) -> ClassifierScreen:
        return ClassifierScreen(self)

    async def judge(self, text: str) -> Verdict:
        try:
            result = await self.client.classify(text)
        except ClassifierUnavailable as err:
            if self.settings.fail_mode == "open":
                return ALLOW
            return Verdict.block(UNAVAILABLE_CATEGORY, f"the safety classifier is unavailable ({err})", True)
        if not result.flagged:
            return ALLOW
        category = next((name for name, hit in result.categories.items() if hit), "flagged")
        return Verdict.block(category, f"flagged by the classifier as {category!r}")


class ClassifierScreen:
    """See OutputScreen; one classifier call per window of held-back text."""

    __slots__ = ("_policy", "window_chars", "cleared", "_context", "_held")

    def __init__(self, policy: ClassifierPolicy):
        self._policy = policy
        self.window_chars = policy.window_chars
        self.cleared = 0
        self._context = ""  # the last window of cleared text, judged again with the next one
        self._held = ""

    async def feed(self, delta: str) -> Verdict:
        self._held += delta
        if len(self._held) < self.window_chars:
            return ALLOW
        return await self._judge()

    async def finish(self) -> Verdict:
        return await self._judge() if self._held else ALLOW

    async def _judge(self) -> Verdict:
        verdict = await self._policy.judge(self._context + self._held)
        if verdict.allowed:
            self.cleared += len(self._held)
            self._context = self._held[-self.window_chars:]
            self._held = ""
        return verdict
