"""The router's model registry: aliases and each model name's route (current version, rollout candidate and
weight, previous version), changed at run time through the router's RPCs (`flotilla models ...`).

A name's very first version becomes its current version when the router first sees it registered (the
"adopt" change). After that a new version gets traffic only through a rollout: `rollout` gives a candidate a
weight, `promote` makes it current, `rollback` takes its traffic away (or, after a promotion, makes the
previous version current again). Until an operator changes a route it stays unmanaged: when its current version
has no registered worker at all any more (a single worker restarted with new weights), the newest registered
version is adopted, as a development fleet expects. A managed route never changes on its own.

Every change is logged, kept in a bounded history, reported to a listener (metrics) and, with a state file,
written there atomically, so a restarted router routes exactly as before (and a rollout's conversations keep
their buckets: models.affinity_bucket).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from flotilla.router.models import ModelVersionRef, Route, newest_version

logger = logging.getLogger(__name__)

MAX_CHANGES = 200


class RouteChangeError(Exception):
    """A route change the router refuses; `kind` is invalid, not_found or precondition."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Change:
    at_unix_s: float
    action: str  # adopt, alias, rollout, promote, rollback
    model: str  # the model name (the alias for an alias change)
    detail: str


Listener = Callable[[Change, str, Route | None], None]  # change, model name, its route now


class ModelRoutes:
    def __init__(self, aliases: Mapping[str, str] | None = None, state_file: str | os.PathLike | None = None,
                 listener: Listener | None = None, wall_clock: Callable[[], float] = time.time):
        self.aliases: dict[str, str] = dict(aliases or {})
        self.routes: dict[str, Route] = {}
        self.changes: deque[Change] = deque(maxlen=MAX_CHANGES)
        self._state_file = Path(state_file) if state_file else None
        self._listeners: list[Listener] = [listener] if listener else []
        self._wall_clock = wall_clock
        if self._state_file is not None and self._state_file.exists():
            self._load()

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)
        for name, route in self.routes.items():  # what a new listener (metrics) would have seen so far
            listener(Change(self._wall_clock(), "load", name, ""), name, route)

    # ---- reading -------------------------------------------------------------------------------------
    def expected_names(self, static: Collection[str]) -> frozenset[str]:
        """Names whose requests may wait for a worker: configured ones, routed ones, alias targets."""
        return frozenset(static) | set(self.routes) | {t.partition("@")[0] for t in self.aliases.values()}

    def model_name(self, requested: str) -> str:
        """The model name a name or alias stands for; raises for an alias that pins a version."""
        target = self.aliases.get(requested, requested)
        name, sep, _ = target.partition("@")
        if sep:
            raise RouteChangeError("invalid", f"{requested!r} pins {target!r}: roll out on the model name, or "
                                              f"point the alias at the name first")
        return name

    def aliases_of_name(self, name: str) -> list[str]:
        return sorted(a for a, t in self.aliases.items() if t.partition("@")[0] == name)

    def history(self, name: str | None = None) -> list[Change]:
        return [c for c in self.changes if name is None or c.model == name
                or (c.action == "alias" and name in c.detail)]

    # ---- automatic adoption --------------------------------------------------------------------------
    def observe(self, versions: Sequence[ModelVersionRef]) -> None:
        """Adopt a current version for names without one (their first version) and for unmanaged routes
        whose current version no worker serves any more. Cheap: called on every resolution."""
        served = {(ref.name, ref.version) for ref in versions}
        names = {ref.name for ref in versions}
        for name in names:
            route = self.routes.get(name)
            if route is not None and (route.managed or (name, route.current) in served):
                continue
            adopted = newest_version(name, versions)
            if adopted is None or (route is not None and route.current == adopted):
                continue
            why = "first version" if route is None or not route.current else f"{route.current} has no worker"
            self._commit("adopt", name, Route(current=adopted), f"current = {adopted} ({why})")

    # ---- operator changes ----------------------------------------------------------------------------
    def set_alias(self, alias: str, target: str) -> Change:
        if not alias or "@" in alias:
            raise RouteChangeError("invalid", f"bad alias name {alias!r}")
        if target == "":
            if alias not in self.aliases:
                raise RouteChangeError("not_found", f"no alias {alias!r}")
            del self.aliases[alias]
            return self._commit("alias", alias, None, f"{alias} deleted")
        if target == alias or target.partition("@")[0] in self.aliases or target in self.aliases:
            raise RouteChangeError("invalid", f"an alias targets a model name or name@version, not an alias: "
                                              f"{alias!r} -> {target!r}")
        if alias in self.routes:
            raise RouteChangeError("invalid", f"{alias!r} is a model name")
        self.aliases[alias] = target
        return self._commit("alias", alias, None, f"{alias} -> {target}")

    def set_rollout(self, requested: str, version: str, percent: float,
                    versions: Sequence[ModelVersionRef]) -> tuple[str, Change]:
        name = self.model_name(requested)
        if not 0.0 <= percent <= 100.0:
            raise RouteChangeError("invalid", f"weight_percent must be within 0..100, got {percent}")
        route = self._route(name)
        candidate = _match_version(name, version, versions)
        if candidate == route.current:
            raise RouteChangeError("invalid", f"{name}@{candidate} is already the current version")
        if route.candidate and route.candidate != candidate:
            raise RouteChangeError("precondition", f"a rollout of {name}@{route.candidate} is in progress: "
                                                   f"promote it or roll it back first")
        action = "rollout" if route.candidate != candidate else "weight"
        new = replace(route, candidate=candidate, candidate_percent=percent, managed=True)
        return name, self._commit("rollout", name, new, f"{action} {candidate} at {percent:g}% "
                                                        f"(current {route.current})")

    def promote(self, requested: str) -> tuple[str, Change]:
        name = self.model_name(requested)
        route = self._route(name)
        if not route.candidate:
            raise RouteChangeError("precondition", f"{name} has no rollout to promote")
        new = Route(current=route.candidate, previous=route.current, managed=True)
        return name, self._commit("promote", name, new, f"current = {route.candidate} (was {route.current})")

    def rollback(self, requested: str, versions: Sequence[ModelVersionRef], reason: str = "") -> tuple[str, Change]:
        name = self.model_name(requested)
        route = self._route(name)
        if route.candidate:
            new = replace(route, candidate="", candidate_percent=0.0, managed=True)
            detail = f"rollout of {route.candidate} ended at {route.candidate_percent:g}%: all to {route.current}"
            return name, self._commit("rollback", name, new, f"{detail} ({reason})" if reason else detail)
        if not route.previous:
            raise RouteChangeError("precondition", f"{name} has no rollout and no previous version to roll back to")
        if not any(ref.name == name and ref.version == route.previous for ref in versions):
            raise RouteChangeError("precondition", f"no worker serves {name}@{route.previous} any more: start its "
                                                   f"pool first")
        new = Route(current=route.previous, previous=route.current, managed=True)
        return name, self._commit("rollback", name, new, f"current = {route.previous} (was {route.current})")

    def _route(self, name: str) -> Route:
        route = self.routes.get(name)
        if route is None or not route.current:
            raise RouteChangeError("not_found", f"model {name!r} has no registered version")
        return route

    def _commit(self, action: str, name: str, route: Route | None, detail: str) -> Change:
        if route is not None:
            self.routes[name] = route
        change = Change(self._wall_clock(), action, name, detail)
        self.changes.append(change)
        logger.info("model route %s %s: %s", action, name, detail)
        self._save()
        for listener in self._listeners:
            listener(change, name, route)
        return change

    # ---- state file ----------------------------------------------------------------------------------
    def _save(self) -> None:
        if self._state_file is None:
            return
        state = {"aliases": self.aliases, "routes": {n: asdict(r) for n, r in self.routes.items()}}
        tmp = self._state_file.with_name(self._state_file.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, self._state_file)

    def _load(self) -> None:
        try:
            state = json.loads(self._state_file.read_text())
            routes = {name: Route(**fields) for name, fields in state.get("routes", {}).items()}
            aliases = {str(a): str(t) for a, t in state.get("aliases", {}).items()}
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"cannot read the model routes file {self._state_file}: {err}") from err
        self.routes = routes
        self.aliases.update(aliases)  # the file's (set at run time) win over the flags'
        logger.info("model routes loaded from %s: %d routes, %d aliases", self._state_file, len(routes),
                    len(self.aliases))


def _match_version(name: str, version: str, versions: Sequence[ModelVersionRef]) -> str:
    """A registered version of `name` equal to `version` or, if none, the only one starting with it."""
    known = sorted({ref.version for ref in versions if ref.name == name})
    if version in known:
        return version
    matches = [v for v in known if version and v.startswith(version)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise RouteChangeError("not_found", f"no worker serves {name}@{version} (registered: "
                                            f"{', '.join(known) or 'none'})")
    raise RouteChangeError("invalid", f"{version!r} matches several versions of {name}: {', '.join(matches)}")
