"""C kernels under csrc/: built with the system C compiler on first use, cached by a digest of the source, the
headers beside it, the flags and the CPU's instruction sets, loaded through ctypes. Where one cannot be built
(no compiler) or FLOTILLA_DISABLE_KERNELS is set, `load()` returns None (logged once) and callers use their
torch path."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")


def _cache_dir() -> Path:
    root = os.environ.get("FLOTILLA_CACHE") or Path.home() / ".cache" / "flotilla"
    return Path(root) / "kernels"


@functools.cache
def cpu_identity() -> bytes:
    """The instruction sets of this machine's CPU, which `-march=native` builds for. A library built on a CPU
    with more of them (AVX-512, say) dies with SIGILL on one with fewer, so a cache directory that outlives the
    machine (a shared home, a persistent volume) must not hand it over: the identity is part of the digest."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, features = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86 / arm64: the first core's line
                    return (platform.machine() + ":" + " ".join(sorted(features.split()))).encode()
    except OSError:
        pass
    return (platform.machine() + ":" + platform.processor()).encode()


def disabled() -> bool:
    return bool(os.environ.get("FLOTILLA_DISABLE_KERNELS"))


def c_compiler() -> str:
    """The C compiler the kernels are built with: $CC, else cc, else gcc. OSError where there is none."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    return compiler


class KernelLibrary:
    """One C source; `declare` sets the ctypes signatures of the loaded library."""

    def __init__(self, source: str, cflags: Sequence[str], declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source = CSRC / source
        self.cflags = list(cflags)
        self._declare = declare
        self._lock = threading.Lock()
        self._loaded: ctypes.CDLL | None = None
        self._failed = False

    def load(self) -> ctypes.CDLL | None:
        if disabled():
            return None
        if self._loaded is not None or self._failed:
            return self._loaded
        with self._lock:
            if self._loaded is None and not self._failed:
                digest = hashlib.sha256(self._inputs()).hexdigest()[:16]
                target = _cache_dir() / f"{self.source.stem}-{digest}.so"
                try:
                    if not target.exists():
                        self._build(target)
                    library = ctypes.CDLL(str(target))
                    self._declare(library)
                    self._loaded = library
                except (OSError, subprocess.CalledProcessError) as error:
                    log.warning("CPU kernel %s unavailable, using the torch path: %s", self.source.name, error)
                    self._failed = True
        return self._loaded

    def _inputs(self) -> bytes:
        """What the built library depends on: the source, the headers beside it (csrc/*.h, which the sources
        include), the flags and the CPU they were built for; a change to any of them builds afresh."""
        headers = b"".join(header.read_bytes() for header in sorted(CSRC.glob("*.h")))
        return self.source.read_bytes() + headers + " ".join(self.cflags).encode() + cpu_identity()

    def _build(self, target: Path) -> None:
        compiler = c_compiler()
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *self.cflags, str(self.source), "-o", str(built), "-lm"], check=True,
                           capture_output=True)
            os.replace(built, target)  # atomic: concurrent builders never load half a library
