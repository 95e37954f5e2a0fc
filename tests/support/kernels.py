"""When the CPU kernels' tests may skip: only where the kernels cannot be built at all (no C compiler, or
FLOTILLA_DISABLE_KERNELS set). Skipping whenever `load()` returned None also hid a kernel that failed to build
on a machine with a compiler: its tests skipped and the engine quietly ran its torch path. With a compiler, a
build failure fails (tests/engine/model/test_kernel_build.py builds each kernel and shows the compiler's error).

Importing this module builds the kernels (cached, so once per machine): at collection, because a unit test may
not start a process, the compiler included (tests/conftest.py)."""

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
