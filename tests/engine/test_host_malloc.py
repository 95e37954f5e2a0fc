"""After keep_freed_host_memory(), a large block freed and allocated again reuses the same pages: the second
allocation takes almost no page faults. glibc's defaults mmap each 64 MiB block afresh (above its largest mmap
threshold, 32 MiB) and fault in all 16,384 pages every time.

Each case runs in its own interpreter: the settings are process-wide and cannot be undone. The blocks come from
libc's malloc itself, not torch.empty: torch asks for aligned memory (posix_memalign), which glibc before 2.38
serves less thriftily from a heap (its resident size grows for a few rounds before it settles)."""

import ctypes
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # each case starts an interpreter

BLOCK_BYTES = 64 << 20
PAGES = BLOCK_BYTES // 4096

FAULTS_PER_ROUND = f"""
import ctypes, resource, sys
from flotilla.engine import host_malloc
if sys.argv[1] == "keep":
    assert host_malloc.keep_freed_host_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc({BLOCK_BYTES})
    ctypes.memset(block, 1, {BLOCK_BYTES})
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _is_glibc() -> bool:
    return hasattr(ctypes.CDLL(None), "gnu_get_libc_version")


def _faults_per_round(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_ROUND, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return [int(count) for count in done.stdout.split()]


@pytest.mark.skipif(not _is_glibc(), reason="the settings are glibc's")
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    first, *again = _faults_per_round("keep")
    assert first >= PAGES * 0.9  # the heap grows once, touching every page
    assert max(again) < PAGES // 100


@pytest.mark.skipif(not _is_glibc(), reason="the settings are glibc's")
def test_without_the_settings_every_block_faults_its_pages_in_again():
    # The control: proves the measurement above can fail, i.e. that glibc's defaults do hand the block back.
    assert min(_faults_per_round("default")) >= PAGES * 0.9


RESIDENT_AFTER_FREE_AND_RELEASE = f"""
import ctypes
from flotilla.engine import host_malloc
assert host_malloc.keep_freed_host_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def resident_pages():
    return int(open("/proc/self/statm").read().split()[1])
block = libc.malloc({BLOCK_BYTES})
ctypes.memset(block, 1, {BLOCK_BYTES})
before_free = resident_pages()
libc.free(block)
after_free = resident_pages()
assert host_malloc.release_load_transients()
print(before_free - after_free, before_free - resident_pages())
"""


@pytest.mark.skipif(not _is_glibc(), reason="the settings are glibc's")
def test_memory_freed_while_loading_goes_back_once_released():
    done = subprocess.run([sys.executable, "-c", RESIDENT_AFTER_FREE_AND_RELEASE], capture_output=True, text=True,
                          timeout=60, check=True)
    returned_on_free, returned_on_release = map(int, done.stdout.split())
    assert returned_on_free < PAGES // 100  # kept, as the settings ask
    assert returned_on_release >= PAGES * 0.9  # given back by the one release after loading


def test_the_engine_config_keeps_freed_memory_by_default():
    from flotilla.engine.config import EngineConfig

    assert EngineConfig(model_dir="unused").keep_freed_host_memory
