"""CPU pinning for the fleet benchmark: every thread of a process, including ones it started before."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loadtest.common.cpu_pinning import pin_process, split_cores

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def test_every_thread_of_a_running_process_is_pinned_and_new_threads_follow():
    script = ("import threading, sys, os; e = threading.Event(); t = threading.Thread(target=e.wait); t.start(); "
              "print('up', flush=True); sys.stdin.readline(); "
              "s = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0)), flush=True)); s.start(); "
              "s.join(); print(sorted(os.sched_getaffinity(t.native_id)), flush=True); e.set()")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        engine, path = split_cores(1)
        pin_process(child.pid, path)
        assert os.sched_getaffinity(child.pid) == set(path)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == str(path)  # a thread started after pinning
        assert child.stdout.readline().strip() == str(path)  # the helper thread that was already running
    finally:
        child.wait(10)
    assert set(engine).isdisjoint(path) and len(engine) == 1


def test_the_path_keeps_at_least_one_core():
    with pytest.raises(ValueError, match="at least one"):
        split_cores(len(os.sched_getaffinity(0)))
