"""Children never outlive their launcher, even a SIGKILLed one: a pipe whose write end only the launcher holds.

Each child gets the read end (FLOTILLA_LIFELINE_FD) and a thread that blocks reading it; when the launcher
dies, however it dies, the kernel closes the write end, the read returns end-of-file and the child exits at
once, freeing its ports. PR_SET_PDEATHSIG was the other way, but it fires when the *thread* that started the
child exits (the autoscaler starts workers from its own thread), is Linux-only, and setting it in the child
before exec needs preexec_fn, which is unsafe in a process with threads.
"""

from __future__ import annotations

import os
import sys
import threading

ENV_VAR = "FLOTILLA_LIFELINE_FD"
EXIT_CODE = 70  # what a child exits with when its launcher is gone

_lock = threading.Lock()
_read_fd: int | None = None  # this process's pipe; its write end stays open (and unused) until we exit


def child_fd() -> int:
    """The read end to pass to every child (pass_fds) under ENV_VAR; one pipe per launcher process."""
    global _read_fd
    with _lock:
        if _read_fd is None:
            # Both ends are close-on-exec: only children given the read end get it; the write end is never
            # closed, so it stays open exactly as long as this process lives.
            _read_fd = os.pipe()[0]
        return _read_fd


def exit_with_launcher() -> None:
    """In a child: exit as soon as the launcher that started it is gone (a no-op when started otherwise)."""
    fd = os.environ.pop(ENV_VAR, None)  # our own children get their own lifeline, not ours
    if fd is None:
        return
    threading.Thread(target=_watch, args=(int(fd),), name="lifeline", daemon=True).start()


def _watch(fd: int) -> None:
    try:
        while os.read(fd, 1):  # nobody writes: this returns only at end-of-file
            pass
    except OSError:
        pass
    print("flotilla: the launcher that started this service is gone; exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)
