"""Model name resolution, pure: a requested model (alias, bare name or name@version) to one version.

- an alias maps to a name or name@version (set at run time, one level deep);
- name@version names exactly that version;
- a bare name follows its route (model_routes.py): the current version, or during a rollout the candidate for
  the conversations whose affinity key buckets below the candidate's weight. A version the split picks that has
  no healthy worker while the other one has gives way to it (availability over stickiness);
- without a route (no route table given) a bare name means the newest registered version, preferring versions
  that a healthy worker serves right now;
- a name that no worker serves yet but that the router is configured to expect resolves with version None:
  its requests wait in the queue for a worker to register.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

NUM_BUCKETS = 10_000  # a rollout's weight has a resolution of 0.01 percentage points


class ModelNotFoundError(LookupError):
    def __init__(self, requested: str):
        super().__init__(f"model {requested!r} is not served here")
        self.requested = requested


@dataclass(frozen=True)
class ModelVersionRef:
    name: str
    version: str
    first_registered: float  # when a worker first registered this version: newer wins for a bare name
    has_healthy_worker: bool


class Resolution(NamedTuple):
    name: str
    version: str | None  # None: an expected model that no worker serves yet

    @property
    def qualified(self) -> str:
        return f"{self.name}@{self.version}" if self.version else self.name


@dataclass(frozen=True)
class Route:
    """Where a model name's traffic goes: its current version, and during a rollout a candidate that takes
    `candidate_percent` of the conversations. `managed`: an operator set it (the router never adopts a version
    on its own then); `previous`: what a rollback after a promotion returns to."""

    current: str = ""
    candidate: str = ""
    candidate_percent: float = 0.0
    previous: str = ""
    managed: bool = False

    def version_for(self, name: str, affinity_key: str) -> str:
        if self.candidate and in_candidate_share(name, self.candidate, affinity_key, self.candidate_percent):
            return self.candidate
        return self.current

    def other_version(self, version: str) -> str:
        """The other side of the split ("" without a rollout)."""
        if not self.candidate:
            return ""
        return self.current if version == self.candidate else self.candidate


def affinity_bucket(name: str, candidate: str, affinity_key: str) -> int:
    """A conversation's bucket in [0, NUM_BUCKETS) for one rollout (model name + candidate version): a hash, so
    it is the same on every router and after a restart; growing the weight only moves conversations onto the
    candidate, never back."""
    digest = hashlib.blake2b(f"{name}\0{candidate}\0{affinity_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % NUM_BUCKETS


def in_candidate_share(name: str, candidate: str, affinity_key: str, percent: float) -> bool:
    return affinity_bucket(name, candidate, affinity_key) < round(percent * NUM_BUCKETS / 100)


def resolve_model(
    requested: str,
    versions: Sequence[ModelVersionRef],
    aliases: Mapping[str, str],
    expected_names: Collection[str] = (),
    routes: Mapping[str, Route] | None = None,
    affinity_key: str = "",
) -> Resolution:
    target = aliases.get(requested, requested)
    name, sep, version = target.partition("@")
    if sep:
        if any(ref.name == name and ref.version == version for ref in versions):
            return Resolution(name, version)
        raise ModelNotFoundError(requested)
    route = routes.get(name) if routes is not None else None
    if route is not None and route.current:
        return Resolution(name, _routed_version(name, route, affinity_key, versions))
    newest = newest_version(name, versions)
    if newest is not None:
        return Resolution(name, newest)
    if name in expected_names:
        return Resolution(name, None)
    raise ModelNotFoundError(requested)


def _routed_version(name: str, route: Route, affinity_key: str, versions: Sequence[ModelVersionRef]) -> str:
    chosen = route.version_for(name, affinity_key)
    other = route.other_version(chosen)
    if other and not _has_healthy(name, chosen, versions) and _has_healthy(name, other, versions):
        return other
    return chosen


def _has_healthy(name: str, version: str, versions: Sequence[ModelVersionRef]) -> bool:
    return any(ref.name == name and ref.version == version and ref.has_healthy_worker for ref in versions)


def newest_version(name: str, versions: Sequence[ModelVersionRef]) -> str | None:
    matches = [ref for ref in versions if ref.name == name]
    if not matches:
        return None
    best = max(matches, key=lambda ref: (ref.has_healthy_worker, ref.first_registered))
    return best.version


def aliases_of(ref: ModelVersionRef, versions: Sequence[ModelVersionRef], aliases: Mapping[str, str],
               routes: Mapping[str, Route] | None = None) -> list[str]:
    """The aliases that resolve to this version now (for a name in a rollout: to its current version)."""
    found = []
    for alias in sorted(aliases):
        try:
            resolution = resolve_model(alias, versions, aliases, routes=routes)
        except ModelNotFoundError:
            continue
        if resolution == (ref.name, ref.version):
            found.append(alias)
    return found


def expected_names(model_names: Collection[str], aliases: Mapping[str, str]) -> frozenset[str]:
    """Names whose requests may wait for a worker: the configured models and every alias target's name."""
    return frozenset(model_names) | {target.partition("@")[0] for target in aliases.values()}
