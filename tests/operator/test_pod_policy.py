"""What a FlotillaPool may ask of its worker pods (operator/pod_policy.py): images by repository, hostPath only
when allowed; read from the environment the chart sets."""

from __future__ import annotations

import pytest

from flotilla.operator.pod_policy import PodPolicy, repository
from flotilla.operator.pool_spec import parse_spec

SPEC = {"model": {"name": "m", "checkpoint": "/models/m"}, "worker": {"image": "ghcr.io/flotilla/flotilla:0.1.0"}}
HOST_PATH = {"name": "model", "hostPath": {"path": "/var/lib/models", "type": "Directory"}}


def pool(image: str = "ghcr.io/flotilla/flotilla:0.1.0", volumes=()):
    return parse_spec({**SPEC, "worker": {"image": image, "volumes": list(volumes)}})


@pytest.mark.parametrize("image,repo", [
    ("ghcr.io/flotilla/flotilla:0.1.0", "ghcr.io/flotilla/flotilla"),
    ("registry:5000/team/flotilla", "registry:5000/team/flotilla"),
    ("registry:5000/team/flotilla:1.2@sha256:" + "a" * 64, "registry:5000/team/flotilla"),
    ("flotilla@sha256:" + "b" * 64, "flotilla"),
])
def test_repository_drops_tag_and_digest_not_the_registry_port(image, repo):
    assert repository(image) == repo


def test_images_by_repository_and_host_path_only_when_allowed():
    policy = PodPolicy(allowed_images=("ghcr.io/flotilla/flotilla",))
    assert policy.violations(pool()) == []
    assert policy.violations(pool("ghcr.io/flotilla/flotilla:0.2.0@sha256:" + "c" * 64)) == []  # any tag
    (why,) = policy.violations(pool("docker.io/library/busybox:1.36"))
    assert "busybox" in why and "operator.podPolicy.extraImages" in why
    assert policy.violations(pool("ghcr.io/flotilla/flotilla-evil:0.1.0"))  # a prefix is not the repository
    (why,) = policy.violations(pool(volumes=[HOST_PATH]))
    assert "hostPath" in why and "allowHostPath" in why
    assert PodPolicy(allow_host_path=True).violations(pool("any/image:1", [HOST_PATH])) == []
    assert PodPolicy().violations(pool(volumes=[{"name": "m", "persistentVolumeClaim": {"claimName": "c"}}])) == []


def test_from_env(monkeypatch):
    monkeypatch.delenv("FLOTILLA_OPERATOR_ALLOWED_IMAGES", raising=False)
    monkeypatch.delenv("FLOTILLA_OPERATOR_ALLOW_HOST_PATH", raising=False)
    assert PodPolicy.from_env() == PodPolicy((), False)  # unset: any image, never hostPath
    monkeypatch.setenv("FLOTILLA_OPERATOR_ALLOWED_IMAGES", '["a/b", "c/d"]')
    monkeypatch.setenv("FLOTILLA_OPERATOR_ALLOW_HOST_PATH", "true")
    assert PodPolicy.from_env() == PodPolicy(("a/b", "c/d"), True)
    for name, bad in (("FLOTILLA_OPERATOR_ALLOWED_IMAGES", '"a/b"'), ("FLOTILLA_OPERATOR_ALLOWED_IMAGES", '[""]'),
                      ("FLOTILLA_OPERATOR_ALLOW_HOST_PATH", "yes")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError):
            PodPolicy.from_env()
        monkeypatch.setenv(name, '["a/b"]' if name.endswith("IMAGES") else "false")
