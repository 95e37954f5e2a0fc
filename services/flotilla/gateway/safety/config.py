"""The gateway's safety configuration: named policies and the default, from a JSON file read at start-up.

    {"default": "standard",
     "policies": {"standard": {"window_chars": 32,
                               "rules": [{"category": "weapons", "terms": ["..."], "patterns": ["..."]}],
                               "classifier": {"url": "http://127.0.0.1:9000/v1/moderations",
                                              "timeout_s": 2, "fail_mode": "closed"}},
                  "off": {}}}

A key record's `safety_policy` names the policy for its requests; empty means the default (none: no
screening). Every pattern is compiled when the file is loaded, so a bad one stops the gateway from starting.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from flotilla.gateway.safety.policy import SafetyPolicy
from flotilla.gateway.safety.rules import PolicyError


class SafetyConfig:
    def __init__(self, policies: Mapping[str, SafetyPolicy], default: str | None = None):
        if default is not None and default not in policies:
            raise PolicyError(f"the default safety policy {default!r} is not one of {sorted(policies)}")
        self.policies = dict(policies)
        self.default = default

    @classmethod
    def from_json(cls, document: object, where: str = "safety config") -> SafetyConfig:
        if not isinstance(document, Mapping) or not set(document) <= {"default", "policies"} \
                or not isinstance(document.get("policies", {}), Mapping):
            raise PolicyError(f'{where}: expected {{"default": name, "policies": {{name: policy}}}}')
        policies = {name: SafetyPolicy.from_json(name, item) for name, item in document.get("policies", {}).items()}
        return cls(policies, document.get("default"))

    @classmethod
    def load(cls, path: str | Path) -> SafetyConfig:
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise PolicyError(f"safety config {path}: {err}") from None
        return cls.from_json(document, f"safety config {path}")

    def policy(self, name: str) -> SafetyPolicy | None:
        """The policy named by a key record ("" = the default); None when nothing is screened."""
        name = name or self.default
        if name is None:
            return None
        policy = self.policies.get(name)
        if policy is None:
            raise PolicyError(f"safety policy {name!r} is not configured on this gateway")
        return policy if policy.is_active else None

    async def aclose(self) -> None:
        for policy in self.policies.values():
            await policy.aclose()
