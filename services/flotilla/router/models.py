"""Model name resolution, pure: a requested model (alias, bare name or name@version) to one version.

- an alias maps to a name or name@version (configured, one level deep);
- name@version names exactly that version;
- a bare name means the newest registered version of that name, preferring versions that a healthy worker
  serves right now;
- a name that no worker serves yet but that the router is configured to expect resolves with version None:
  its requests wait in the queue for a worker to register.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


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


def resolve_model(
    requested: str,
    versions: Sequence[ModelVersionRef],
    aliases: Mapping[str, str],
    expected_names: Collection[str] = (),
) -> Resolution:
    target = aliases.get(requested, requested)
    name, sep, version = target.partition("@")
    if sep:
        if any(ref.name == name and ref.version == version for ref in versions):
            return Resolution(name, version)
        raise ModelNotFoundError(requested)
    newest = newest_version(name, versions)
    if newest is not None:
        return Resolution(name, newest)
    if name in expected_names:
        return Resolution(name, None)
    raise ModelNotFoundError(requested)


def newest_version(name: str, versions: Sequence[ModelVersionRef]) -> str | None:
    matches = [ref for ref in versions if ref.name == name]
    if not matches:
        return None
    best = max(matches, key=lambda ref: (ref.has_healthy_worker, ref.first_registered))
    return best.version


def aliases_of(ref: ModelVersionRef, versions: Sequence[ModelVersionRef], aliases: Mapping[str, str]) -> list[str]:
    """The aliases that resolve to this version now."""
    found = []
    for alias in sorted(aliases):
        try:
            resolution = resolve_model(alias, versions, aliases)
        except ModelNotFoundError:
            continue
        if resolution == (ref.name, ref.version):
            found.append(alias)
    return found


def expected_names(model_names: Collection[str], aliases: Mapping[str, str]) -> frozenset[str]:
    """Names whose requests may wait for a worker: the configured models and every alias target's name."""
    return frozenset(model_names) | {target.partition("@")[0] for target in aliases.values()}
