"""The image's contents without an image builder: the Dockerfile's build commands (conftest.py) install the
wheel into a fresh prefix, and its ENTRYPOINT and CMD, and the subcommands the chart runs, work from there with
the runtime stage's environment, writing nothing outside the image's writable paths (/tmp and the cache
volume); the pinned dependencies the test borrows are the ones the Dockerfile installs."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from tests.packaging.conftest import REPO, build_commands
from tests.packaging.dockerfile import stages

# What the chart's containers run (`flotilla <subcommand> ...`; the operator runs kopf, a dependency).
CHART_SUBCOMMANDS = ("gateway", "router", "worker", "probe")


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")}


def test_entrypoint_and_chart_subcommands_run_from_the_prefix(image_install, tmp_path):
    runtime = stages()["runtime"]
    entrypoint, cmd = runtime.exec_form("ENTRYPOINT"), runtime.exec_form("CMD")
    assert entrypoint == ["flotilla"], entrypoint
    before = _snapshot(image_install.prefix)
    resolved = image_install.run(["sh", "-c", f"command -v {entrypoint[0]}"], tmp_path)
    assert resolved.stdout.strip() == str(image_install.prefix / "bin" / "flotilla"), resolved
    result = image_install.run([*entrypoint, *cmd], tmp_path)
    assert result.returncode == 0 and "usage: flotilla" in result.stdout, result.stderr
    for subcommand in CHART_SUBCOMMANDS:
        result = image_install.run([*entrypoint, subcommand, "--help"], tmp_path)
        assert result.returncode == 0, f"flotilla {subcommand} --help: {result.stderr}"
        assert f"usage: flotilla {subcommand}" in result.stdout
    # Read-only root filesystem: nothing written into the installed prefix or the home directory.
    assert _snapshot(image_install.prefix) == before
    assert not list(image_install.home.iterdir())


def test_runtime_environment_points_caches_at_the_writable_volume():
    env = stages()["runtime"].env()
    for key in ("FLOTILLA_CACHE", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR"):
        assert env[key].startswith("/var/cache/flotilla"), (key, env[key])
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    user = [args for keyword, args in stages()["runtime"].instructions if keyword == "USER"]
    assert user == ["10001:10001"], user  # numeric: the kubelet can check runAsNonRoot


def test_the_borrowed_dependencies_are_the_dockerfiles_pins():
    """The fixture takes the dependency layer from this virtualenv: it must hold exactly requirements.txt."""
    assert "--requirement requirements.txt" in build_commands()["dependencies"]
    mismatches = []
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
        if not match:
            continue
        name, pinned = match.groups()
        try:
            installed = importlib.metadata.version(name).split("+")[0]  # torch 2.13.0+cpu satisfies ==2.13.0
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != pinned:
            mismatches.append(f"{name}: pinned {pinned}, installed {installed}")
    assert not mismatches, "run `make install`: " + "; ".join(mismatches)


@pytest.mark.parametrize("instruction", ["FROM"])
def test_base_images_are_pinned(instruction):
    args = [a for stage in stages().values() for k, a in stage.instructions if k == instruction]
    default = re.search(r"ARG PYTHON_IMAGE=(\S+)", (REPO / "Dockerfile").read_text()).group(1)
    assert all(a.startswith("${PYTHON_IMAGE}") for a in args), args
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", default), default
