"""A named safety policy: rules, an external classifier, or both (rules first: they are cheap).

Both judge a prompt; for an answer their screens run in series, the classifier seeing only what the rules
cleared, so the text held back is at most the sum of their windows.
"""

from __future__ import annotations

from collections.abc import Mapping

from flotilla.gateway.safety.classifier import ClassifierPolicy, ClassifierSettings
from flotilla.gateway.safety.rules import DEFAULT_WINDOW_CHARS, PolicyError, RulesPolicy
from flotilla.gateway.safety.verdict import ALLOW, Moderation, OutputScreen, Verdict

POLICY_FIELDS = {"rules", "window_chars", "classifier"}


class SafetyPolicy:
    def __init__(self, name: str, rules: RulesPolicy | None = None, classifier: ClassifierPolicy | None = None):
        self.name = name
        self.rules = rules
        self.classifier = classifier

    @classmethod
    def from_json(cls, name: str, item: object) -> SafetyPolicy:
        where = f"safety policy {name!r}"
        if not isinstance(item, Mapping) or not set(item) <= POLICY_FIELDS:
            raise PolicyError(f"{where}: expected an object with {sorted(POLICY_FIELDS)}, got {item!r}")
        window = item.get("window_chars", DEFAULT_WINDOW_CHARS)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise PolicyError(f"{where}: window_chars must be an integer >= 1, got {window!r}")
        rules = RulesPolicy.from_json(item["rules"], window, where) if "rules" in item else None
        classifier = (ClassifierPolicy(ClassifierSettings.from_json(item["classifier"], where))
                      if "classifier" in item else None)
        return cls(name, rules, classifier)

    @property
    def is_active(self) -> bool:
        return self.rules is not None or self.classifier is not None

    async def screen_input(self, text: str) -> Verdict:
        if self.rules is not None and not (verdict := self.rules.screen_input(text)).allowed:
            return verdict
        if self.classifier is not None:
            return await self.classifier.screen_input(text)
        return ALLOW

    def output_screen(self) -> OutputScreen | None:
        screens = [p.output_screen() for p in (self.rules, self.classifier) if p is not None]
        if len(screens) < 2:
            return screens[0] if screens else None
        return SeriesScreen(*screens)

    async def moderate(self, text: str) -> Moderation:
        categories: dict[str, bool] = {}
        if self.rules is not None:
            categories.update(self.rules.moderate(text).categories)
        if self.classifier is not None:
            for category, hit in (await self.classifier.moderate(text)).categories.items():
                categories[category] = categories.get(category, False) or hit
        return Moderation(any(categories.values()), categories)

    async def aclose(self) -> None:
        if self.classifier is not None:
            await self.classifier.client.aclose()


class SeriesScreen:
    """`second` is fed only what `first` cleared; what `second` cleared is cleared."""

    __slots__ = ("_first", "_second", "window_chars", "_pending", "_passed")

    def __init__(self, first: OutputScreen, second: OutputScreen):
        self._first = first
        self._second = second
        self.window_chars = first.window_chars + second.window_chars
        self._pending = ""  # fed to first and not yet passed to second
        self._passed = 0  # characters passed to second

    @property
    def cleared(self) -> int:
        return self._second.cleared

    async def feed(self, delta: str) -> Verdict:
        self._pending += delta
        verdict = await self._first.feed(delta)
        return verdict if not verdict.allowed else await self._forward(self._second.feed)

    async def finish(self) -> Verdict:
        verdict = await self._first.finish()
        if not verdict.allowed or not (verdict := await self._forward(self._second.feed)).allowed:
            return verdict
        return await self._second.finish()

    async def _forward(self, feed) -> Verdict:
        newly_cleared = self._first.cleared - self._passed
        if not newly_cleared:
            return ALLOW
        text, self._pending = self._pending[:newly_cleared], self._pending[newly_cleared:]
        self._passed += newly_cleared
        return await feed(text)
