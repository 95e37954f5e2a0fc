"""The wheel is the distribution a container image installs: it must hold every module, the generated gRPC
stubs and the decode kernel's C source, and work with the source tree out of sight.

The wheel is built from a copy of the checkout without generated files (as a clean clone has it), installed
into a fresh virtualenv outside the source tree, and exercised from there. Third-party packages come from
the project's own virtualenv through a path entry (reinstalling torch and the rest would take minutes); the
project's editable install is not visible there, so every `flotilla` module must come from the wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Run in the fresh virtualenv: imports every module the wheel lists, from the wheel's files only.
CHECK_INSTALLED = textwrap.dedent("""
    import importlib, importlib.metadata, sys
    from pathlib import Path

    site = Path(sys.argv[1]).resolve()
    files = [f for f in importlib.metadata.files("flotilla") if f.suffix == ".py"]
    modules = sorted(".".join(f.with_suffix("").parts).removesuffix(".__init__") for f in files
                     if f.parts[0] == "flotilla" and f.name != "__main__.py")
    # kopf's entry module registers its handlers, and so connects to a cluster, when imported: listed only.
    entry_modules = {"flotilla.operator.main"}
    for name in modules:
        if name in entry_modules:
            continue
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(site), f"{name} imported from {module.__file__}"
    for expected in ("flotilla.api.worker.v1.worker_pb2_grpc", "flotilla.autoscaling.control",
                     "flotilla.autoscaler.supervisor", "flotilla.operator.handlers", "flotilla.cli",
                     *entry_modules):
        assert expected in modules, f"{expected} is not in the wheel"

    import torch
    from flotilla.engine.model import decode_kernel
    from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention

    assert decode_kernel.SOURCE.resolve().is_relative_to(site), decode_kernel.SOURCE
    assert decode_kernel.load() is not None, "the decode kernel did not build from the installed source"
    torch.manual_seed(0)
    kv_cache = torch.randn(2, 16, 4, 2, 16)
    seqs = [SeqChunk(9, 1, [3, 7, 1]), SeqChunk(0, 1, [5]), SeqChunk(13, 1, [0, 2, 9, 11])]
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    results = []
    for use_kernel in (False, True):
        meta = AttentionMetadata.build(seqs, 4, torch.device("cpu"), use_decode_kernel=use_kernel)
        assert (meta.decode_rows is not None) == use_kernel
        results.append(paged_attention(q, k, v, kv_cache.clone(), meta))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    print(f"imported {len(modules)} modules; decode kernel built and agrees with the torch path")
""")


def _clean_copy(destination: Path) -> None:
    """Tracked and untracked-but-not-ignored files: what a clean clone of this working tree holds."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh virtualenv with the wheel installed; returns its python."""
    root = tmp_path_factory.mktemp("wheel")
    source, dist, env_dir = root / "source", root / "dist", root / "venv"
    _clean_copy(source)
    assert not (source / "libs" / "flotilla" / "api").exists()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(dist), str(source)], check=True, cwd=root)
    (wheel,) = dist.glob("flotilla-*.whl")
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, cwd=root)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["FLOTILLA_CACHE"] = str(cwd / "cache")  # the kernel is built anew from the installed source
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_module_imports_from_the_wheel_and_the_kernel_builds(installed, tmp_path):
    site = _run([str(installed), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path)
    check = tmp_path / "check_installed.py"
    check.write_text(CHECK_INSTALLED)
    result = _run([str(installed), str(check), site.stdout.strip()], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decode kernel built" in result.stdout


def test_console_script_runs_from_the_wheel(installed, tmp_path):
    result = _run([str(installed.parent / "flotilla"), "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    for subcommand in ("up", "gateway", "worker", "router", "keys", "model"):
        assert subcommand in result.stdout
