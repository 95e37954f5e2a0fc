"""Keep the memory torch frees on the host for reuse, instead of handing it back to the kernel (glibc malloc).

Why: on a cpu device every engine step allocates its activations afresh (torch has no caching allocator on cpu).
glibc serves blocks above its mmap threshold (128 KiB, rising with use to at most 32 MiB) with fresh mmaps and
trims the top of its heaps on free, so each step's tensors fault their pages in again and the kernel zeroes every
one of them. A 2,048-token prefill step took ~17,000 minor faults on the tiny test model and ~170,000 on the small
one (whose 2,048 x 4,608 gate/up activation, 38 MB, is above any threshold); with the settings below, ~0 to ~1,000,
and small's prefill steps went from ~920 to ~815 ms (docs/performance.md). tcmalloc and jemalloc keep freed memory
the same way; these settings get that from the allocator every Debian and manylinux system already has.

The cost: the process's resident size stays at its high-water mark instead of shrinking between bursts (+~150 MiB
on the small model's bench run; what loading freed is handed back once, by release_load_transients). torch asks
for aligned blocks (posix_memalign), which glibc before 2.38 (Debian 12 has 2.36) carves less thriftily from a
heap: 64 MiB tensors allocated and freed in a loop grew the resident size from 284 to 732 MiB over the first rounds
before it settled. Settings are process-wide and stay for the process's life; other C libraries (musl, macOS) are
left as they are.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

KEEP_FREED_SETTINGS = (
    (M_MMAP_MAX, 0),  # large blocks come from the heaps, which keep them on free, not from mmaps that are unmapped
    (M_TRIM_THRESHOLD, -1),  # never give the top of a heap back (-1: the largest size_t)
    # A thread's arena (the worker steps its engine on its own thread) also deletes a whole heap once its top chunk
    # spans it, unless the heap below could not hold this much more; 64 MiB (a heap's largest size) means never.
    # Main-arena growth asks for this much beyond the request too: address space, not memory, until touched.
    (M_TOP_PAD, 64 << 20),
)


def _glibc():
    """The process's C library when it is glibc (whose malloc these settings and calls are for), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_host_memory() -> bool:
    """Apply KEEP_FREED_SETTINGS to this process's malloc. True when applied; False where the C library is not
    glibc (nothing changes)."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = all([mallopt(parameter, value) == 1 for parameter, value in KEEP_FREED_SETTINGS])
    if not applied:
        log.warning("glibc refused a malloc setting; freed host memory may still go back to the kernel")
    return applied


def release_load_transients() -> bool:
    """Hands the free memory in malloc's heaps back to the kernel once (malloc_trim), whatever the settings above.

    Why: loading leaves the heaps holding what it freed (each dense weight after its packed copy is made, staging
    copies); with the settings above that would stay resident for the process's life. Called when the engine is
    loaded: small's bench process held 1,873 MiB after load and 1,954 after a run without it, 1,557 and 1,819 with
    it, at the same speed (the first steps fault their activations in once). True when glibc did it."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim(0)
    return True
