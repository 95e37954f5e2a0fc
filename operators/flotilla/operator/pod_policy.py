"""What a FlotillaPool may ask of its worker pods, decided by whoever installs the operator (chart values
operator.podPolicy), not by whoever writes the pool: which images it may run and whether it may mount a node's
files (hostPath). Everything else about the pods (security contexts, service-account token, probes) is fixed
by the manifest builders and not in the spec at all."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from flotilla.operator.pool_spec import PoolSpec


@dataclass(frozen=True)
class PodPolicy:
    # Image repositories (registry/path, without tag or digest) a pool may run; empty: any image.
    allowed_images: tuple[str, ...] = ()
    allow_host_path: bool = False

    @classmethod
    def from_env(cls) -> PodPolicy:
        """FLOTILLA_OPERATOR_ALLOWED_IMAGES (a JSON list of repositories; unset: any image),
        FLOTILLA_OPERATOR_ALLOW_HOST_PATH (true/false, default false)."""
        images = json.loads(os.environ.get("FLOTILLA_OPERATOR_ALLOWED_IMAGES") or "[]")
        if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
            raise ValueError("FLOTILLA_OPERATOR_ALLOWED_IMAGES must be a JSON list of image repositories")
        allow = os.environ.get("FLOTILLA_OPERATOR_ALLOW_HOST_PATH", "false").lower()
        if allow not in ("true", "false"):
            raise ValueError("FLOTILLA_OPERATOR_ALLOW_HOST_PATH must be true or false")
        return cls(allowed_images=tuple(images), allow_host_path=allow == "true")

    def violations(self, spec: PoolSpec) -> list[str]:
        """Why these worker pods may not run; [] when they may."""
        found = []
        if self.allowed_images and repository(spec.worker.image) not in self.allowed_images:
            found.append(f"image {spec.worker.image!r} is not allowed (allowed repositories: "
                         f"{', '.join(self.allowed_images)}; chart value operator.podPolicy.extraImages)")
        if not self.allow_host_path:
            for volume in spec.worker.volumes:
                if "hostPath" in volume:
                    found.append(f"volume {volume.get('name')!r} is a hostPath, which is not allowed "
                                 "(chart value operator.podPolicy.allowHostPath)")
        return found


def repository(image: str) -> str:
    """`registry:5000/a/b:tag@sha256:...` -> `registry:5000/a/b` (a port is not a tag: only after the last /)."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name
