"""The C kernels' build cache is keyed on the CPU they are built for (`-march=native`): a library built on one
CPU is never loaded on another from a cache directory both share."""

import subprocess

import pytest

from flotilla.engine.model import fused_ops, kernel_build
from tests.support.kernels import KERNEL_MODULES, needs_kernels

# Builds with the real compiler (a process): not the unit tier.
pytestmark = [pytest.mark.integration, needs_kernels]


def test_this_cpus_identity_names_its_architecture_and_instruction_sets():
    identity = kernel_build.cpu_identity().decode()
    architecture, _, features = identity.partition(":")
    assert architecture and features
    if architecture == "x86_64":  # every x86-64 CPU has SSE2; its flags line lists it
        assert "sse2" in features.split()


def _fresh_library() -> kernel_build.KernelLibrary:
    return kernel_build.KernelLibrary("fused_elementwise.c", fused_ops.CFLAGS, fused_ops._declare)


def test_a_library_built_for_another_cpu_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOTILLA_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "cpu_identity", lambda: b"x86_64:avx avx2 avx512f fma sse2")
    assert _fresh_library().load() is not None
    (built_elsewhere,) = (tmp_path / "kernels").glob("*.so")
    # What a CPU without AVX-512 would do with it: crash on the first instruction it lacks. Stand for that with a
    # file no loader accepts, so that loading it would show. It is a new file, not the loaded one rewritten: this
    # process maps that one, and rewriting it in place brings SIGBUS when the process next touches its pages.
    built_elsewhere.unlink()
    built_elsewhere.write_bytes(b"not a library for this CPU")

    monkeypatch.setattr(kernel_build, "cpu_identity", lambda: b"x86_64:avx avx2 fma sse2")
    library = _fresh_library().load()
    assert library is not None and hasattr(library, "silu_mul_f32")
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2

    # The same CPU again finds its own build and compiles nothing.
    built = {path: path.stat().st_mtime_ns for path in (tmp_path / "kernels").glob("*.so")}
    assert _fresh_library().load() is not None
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "kernels").glob("*.so")} == built


@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda module: module.__name__.rsplit(".", 1)[-1])
def test_each_kernel_builds_from_source_where_there_is_a_compiler(tmp_path, module):
    """The kernels' tests skip only where nothing can build them (tests/support/kernels.py); here a kernel that
    does not build fails, with the compiler's own error."""
    library = module._library
    try:
        library._build(tmp_path / f"{library.source.stem}.so")
    except subprocess.CalledProcessError as error:
        pytest.fail(f"{library.source.name} did not build: {error.stderr.decode(errors='replace')[-2000:]}")
    assert module.load() is not None
