"""The image's installation, outside a container: a fresh virtualenv built with the Dockerfile's own
commands (parsed from its `build` stage: the venv, the wheel built from a clean copy of the checkout, the wheel
installed with the same flags), and the runtime stage's environment mapped onto temporary directories.

One substitution: the dependency layer (`pip install ... --requirement requirements.txt` from the network, torch
from its index) is not run; the project's own virtualenv provides those packages through a path entry, and
test_image_install checks that it holds exactly the pins of requirements.txt."""

from __future__ import annotations

import shlex
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.packaging.dockerfile import stages

REPO = Path(__file__).resolve().parents[2]
IMAGE_PREFIX = "/opt/flotilla"  # the Dockerfile's venv; asserted below
IMAGE_CACHE = "/var/cache/flotilla"  # a writable volume in the chart


@dataclass(frozen=True)
class ImageInstall:
    prefix: Path  # the venv (/opt/flotilla in the image)
    python: Path
    env: dict[str, str]  # the runtime stage's ENV, paths mapped here; HOME and TMPDIR temporary
    home: Path
    cache: Path  # /var/cache/flotilla

    def run(self, command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout)


def clean_copy(destination: Path) -> None:
    """Tracked and untracked-but-not-ignored files: what a clean clone of this working tree holds."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


def build_commands() -> dict[str, str]:
    """The build stage's commands this fixture runs, by role."""
    commands = stages()["build"].run_commands()

    def one(role: str, match) -> str:
        found = [c for c in commands if match(c)]
        if len(found) != 1:
            raise AssertionError(f"the Dockerfile's build stage has {len(found)} {role} commands: {commands}")
        return found[0]

    return {
        "venv": one("venv", lambda c: c.startswith("python -m venv ")),
        "dependencies": one("dependency", lambda c: "--requirement requirements.txt" in c),
        "wheel": one("wheel", lambda c: c.startswith("pip wheel ")),
        "install": one("wheel install", lambda c: c.startswith("pip install ") and ".whl" in c),
    }


def _shell(command: str, cwd: Path, env: dict[str, str]) -> None:
    result = subprocess.run(["sh", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise AssertionError(f"{command!r} failed:\n{result.stdout}\n{result.stderr}")


def runtime_env(prefix: Path, home: Path, cache: Path, tmp: Path) -> dict[str, str]:
    def local(value: str) -> str:
        return value.replace(IMAGE_PREFIX, str(prefix)).replace(IMAGE_CACHE, str(cache))

    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp),
           "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
    for key, value in stages()["runtime"].env().items():
        env[key] = local(value).replace("$PATH", env["PATH"])
    return env


@pytest.fixture(scope="session")
def image_install(tmp_path_factory) -> ImageInstall:
    root = tmp_path_factory.mktemp("image")
    source, prefix, dist = root / "src", root / "opt-flotilla", root / "dist"
    home, cache, tmp = root / "home", root / "cache", root / "tmp"
    for folder in (home, cache, tmp):
        folder.mkdir()
    clean_copy(source)
    assert not (source / "libs" / "flotilla" / "api").exists()
    commands = build_commands()
    assert commands["venv"].split()[-1] == IMAGE_PREFIX, commands["venv"]
    wheel_dir = shlex.split(commands["wheel"])[shlex.split(commands["wheel"]).index("--wheel-dir") + 1]

    def local(command: str) -> str:
        return command.replace(IMAGE_PREFIX, str(prefix)).replace(wheel_dir, str(dist))

    build_env = {**stages()["build"].env(), "PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": str(home)}
    _shell(local(commands["venv"]).replace("python ", f"{shlex.quote(sys.executable)} ", 1), root, build_env)
    # The dependency layer, from the project's virtualenv instead of the network (see the module docstring).
    site = Path(subprocess.run([str(prefix / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # requirements.txt's setuptools replaces the one the venv was created with; here the path entry's must win.
    _shell(f"{prefix}/bin/python -m pip uninstall --quiet --yes setuptools", root, build_env)
    _shell(local(commands["wheel"]), source, build_env)
    _shell(local(commands["install"]), root, build_env)
    return ImageInstall(prefix, prefix / "bin" / "python", runtime_env(prefix, home, cache, tmp), home, cache)

