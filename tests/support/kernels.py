"""When the CPU kernels' tests may skip: only where the kernels cannot be built at all (no C compiler, or
FLOTILLA_DISABLE_KERNELS set). Skipping whenever `load()` returned None also hid a kernel that failed to build
on a machine with a compiler: its tests skipped and the engine quietly ran its torch path. With a compiler, a
build failure fails (tests/engine/model/test_kernel_build.py builds each kernel and shows the compiler's error).

Importing this module builds the kernels (cached, so once per machine): at collection, because a unit test may
not start a process, the compiler included (tests/conftest.py)."""

import platform
from types import ModuleType

import pytest

from flotilla.engine.model import decode_kernel, fused_ops, kernel_build, panel_gemm, prefill_kernel

KERNEL_MODULES = (decode_kernel, prefill_kernel, fused_ops, panel_gemm)


def kernels_cannot_build() -> bool:
    if kernel_build.disabled():
        return True
    try:
        kernel_build.c_compiler()
    except OSError:
        return True
    return False


needs_kernels = pytest.mark.skipif(kernels_cannot_build(),
                                   reason="no C compiler for the CPU kernels, or FLOTILLA_DISABLE_KERNELS set")


if not kernels_cannot_build():
    for _module in KERNEL_MODULES:
        _module.load()


def kernel_build_fixture(module: ModuleType):
    """A `kernel_build` fixture for a kernel module's tests, parametrized "native" and "avx2". "avx2" swaps in the
    module's kernel built without AVX-512 (x86-64 only): its narrower code, which CPUs without AVX-512 run, is
    otherwise never tested on one that has it. Built here, at collection, as the native build is: a unit test may
    not start a process. The module needs `_library` (a KernelLibrary), `CFLAGS` and `_declare`."""
    avx2_build = None
    if platform.machine() in ("x86_64", "AMD64") and not kernels_cannot_build():
        avx2_build = kernel_build.KernelLibrary(module._library.source.name, [*module.CFLAGS, "-mno-avx512f"],
                                                module._declare)
        avx2_build.load()  # one that fails to build fails the avx2 cases (no library to call), not skips them

    @pytest.fixture(params=["native", "avx2"], name="kernel_build")
    def build(request, monkeypatch):
        if request.param == "avx2":
            if avx2_build is None:
                pytest.skip("no x86-64 build without AVX-512 here")
            monkeypatch.setattr(module, "_library", avx2_build)
        return request.param

    return build
