"""`make image` with whatever builder is on PATH (a recording stand-in here: no daemon on this machine), and a
clear refusal when there is none."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("make", "sed", "git")  # what the recipe needs besides the builder


def _path_with(tmp_path: Path, builder: str | None) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} not found")
        (bin_dir / tool).symlink_to(found)
    if builder:
        script = bin_dir / builder
        script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/{builder}.args\n')
        script.chmod(0o755)
    return str(bin_dir)


def make_image(tmp_path: Path, builder: str | None, *variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": _path_with(tmp_path, builder)}
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "image", *variables], env=env,
                          capture_output=True, text=True, timeout=60)


def test_no_builder_is_a_clear_error(tmp_path):
    result = make_image(tmp_path, None)
    assert result.returncode != 0
    assert "no image builder found: install docker, podman or buildah" in result.stderr


@pytest.mark.parametrize("builder, verb", [("podman", "build"), ("buildah", "bud")])
def test_builds_with_the_builder_found(tmp_path, builder, verb):
    result = make_image(tmp_path, builder)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / f"{builder}.args").read_text().split()
    assert args[0] == verb and args[-1] == "."
    assert args[args.index("--file") + 1] == "Dockerfile"
    assert args[args.index("--tag") + 1] == "ghcr.io/flotilla/flotilla:0.1.0"
    assert "TORCH_VARIANT=cpu" in args and "VERSION=0.1.0" in args


def test_cuda_variant_is_tagged_apart(tmp_path):
    result = make_image(tmp_path, "podman", "TORCH_VARIANT=cu128")
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "podman.args").read_text().split()
    assert "TORCH_VARIANT=cu128" in args
    assert args[args.index("--tag") + 1] == "ghcr.io/flotilla/flotilla:0.1.0-cu128"
